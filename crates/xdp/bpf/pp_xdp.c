// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
//
// pp_xdp: the PP node's XDP program. The fast path of docs/xdp.md.
//
// For VXLAN (UDP 4789) to the node's own underlay address it builds the same 40-byte
// FlowKey as the userspace pipeline (crates/pipeline/src/key.rs) from the inner packet and
// looks it up in `offloaded_rules`. On a hit it runs the rule's actions in the driver: NAT
// rewrite with RFC 1624 incremental checksums, VXLAN decap and re-encap, per-rule
// counters, then XDP_TX. Everything the program does not handle itself (a miss, a packet
// shape it does not parse the way the userspace parser does) goes up to the userspace
// pipeline: to the AF_XDP socket bound on this queue in `xsks`, or to the kernel when no
// socket is bound. ESP to the node goes up too (the IPsec gateway). Anything else
// (ARP, management) goes to the kernel.
//
// The byte-level semantics mirror crates/packet/src/rewrite.rs and csum.rs exactly (the
// golden corpus checks both paths give identical frames): src is rewritten before dst,
// each side patches the checksums with its own delta, `HC' = ~(~HC + sum(~m + m'))`,
// a UDP checksum of 0 stays 0 and a computed 0 is sent as 0xffff.
//
// No libbpf headers: the few helpers are declared here by number.

#include <linux/bpf.h>
#include <linux/types.h>

/* Map names and capacities, rule flags (F_*), and struct flow_key / xdp_rule / xdp_node,
 * generated from crates/xdp/src/abi.rs by the build script (-I$OUT_DIR). */
#include "pp_xdp_abi.h"

#undef __always_inline
#define __always_inline inline __attribute__((always_inline))

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_xdp_adjust_head)(struct xdp_md *ctx, int delta) = (void *)BPF_FUNC_xdp_adjust_head;
static long (*bpf_xdp_adjust_tail)(struct xdp_md *ctx, int delta) = (void *)BPF_FUNC_xdp_adjust_tail;
static long (*bpf_redirect_map)(void *map, __u64 key, __u64 flags) = (void *)BPF_FUNC_redirect_map;
/* CLOCK_MONOTONIC_COARSE: a load of the timekeeper's last tick instead of a clock read
 * (read_tsc was 2.5% of the fast path's CPU under perf). Idle expiry works in seconds, and
 * the coarse clock only ever lags the exact one (by at most a tick), so userspace's
 * CLOCK_MONOTONIC comparisons can only see a flow as idle later, never sooner. */
static __u64 (*bpf_ktime_get_coarse_ns)(void) = (void *)BPF_FUNC_ktime_get_coarse_ns;

#define bswap16(x) __builtin_bswap16(x)

#define ETH_HLEN 14
#define VXLAN_PORT 4789
#define VXLAN_V4_OVERHEAD 50 /* Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8 */
#define IPPROTO_ICMP 1
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define IPPROTO_ESP 50
#define IPPROTO_ICMPV6 58

/* IPv6 extension headers walked in the driver, and how far the transport header may sit
 * from the IPv6 header. Longer chains go up to userspace. */
#define MAX_V6_EXT 4
#define MAX_V6_EXT_OFF 1024

static __always_inline __u16 get16(const __u8 *p)
{
	return ((__u16)p[0] << 8) | p[1];
}

static __always_inline void put16(__u8 *p, __u16 v)
{
	p[0] = v >> 8;
	p[1] = v & 0xff;
}

static __always_inline __u16 fold(__u64 s)
{
	/* Five rounds bring any 64-bit sum to 16 bits. */
#pragma unroll
	for (int i = 0; i < 5; i++)
		s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624 eqn. 3 on a checksum field: HC' = ~(~HC + delta). */
static __always_inline __u16 csum_apply(__u16 csum, __u64 delta)
{
	return (__u16)~fold((__u64)(__u16)~csum + delta);
}

static __always_inline __u64 word_delta(__u16 old, __u16 new)
{
	return (__u64)(__u16)~old + new;
}

/* Replace the u16 at `p`, returning the checksum delta. */
static __always_inline __u64 swap16(__u8 *p, __u16 new)
{
	__u16 old = get16(p);
	put16(p, new);
	return word_delta(old, new);
}

/* Replace the IPv4 address at `p` (4 bytes), returning the checksum delta. */
static __always_inline __u64 swap_addr4(__u8 *p, const __u8 *new)
{
	__u64 d = swap16(p, get16(new));
	d += swap16(p + 2, get16(new + 2));
	return d;
}

/* Replace the IPv6 address at `p` (16 bytes), returning the checksum delta. */
static __always_inline __u64 swap_addr6(__u8 *p, const __u8 *new)
{
	__u64 d = 0;
#pragma unroll
	for (int i = 0; i < 16; i += 2)
		d += swap16(p + i, get16(new + i));
	return d;
}

/* `::ffff:0:0/96`. */
static __always_inline int is_v4_mapped(const __u8 *a)
{
	for (int i = 0; i < 10; i++)
		if (a[i])
			return 0;
	return a[10] == 0xff && a[11] == 0xff;
}

/*
 * Rewrite one side (src = 0, dst = 1) of the packet, as packet::rewrite_endpoint.
 * `port_at` is the offset of this side's port from `l4`, or -1 when the packet has none
 * on this side (the id-less side of an ICMP echo). The caller has checked that the IP
 * header and the transport header (20 bytes for TCP, 8 otherwise) lie in the packet.
 */
static __always_inline void rewrite_side(__u8 *ip, __u8 *l4, void *data_end, __u8 proto, int v6,
					 int port_at, int have_addr, const __u8 *addr, int have_port,
					 __u16 port, int side)
{
	__u64 addr_delta = 0, l4_delta = 0;

	if (have_addr) {
		if (v6) {
			/* Checked by the caller; said again for the verifier, which does not
			 * tie `v6` (or `proto`) to the branch that checked the length. */
			if (ip + 40 > (__u8 *)data_end)
				return;
			addr_delta = swap_addr6(ip + (side ? 24 : 8), addr);
		} else {
			addr_delta = swap_addr4(ip + (side ? 16 : 12), addr);
			put16(ip + 10, csum_apply(get16(ip + 10), addr_delta));
		}
	}
	/* ICMPv4's checksum has no pseudo-header; every other transport checksum does. */
	if (proto != IPPROTO_ICMP)
		l4_delta += addr_delta;
	if (have_port && port_at >= 0)
		l4_delta += swap16(l4 + port_at, port);
	if (l4_delta == 0)
		return;
	if (proto == IPPROTO_TCP) {
		/* Checked by the caller; again for the verifier, as above. */
		if (l4 + 20 > (__u8 *)data_end)
			return;
		put16(l4 + 16, csum_apply(get16(l4 + 16), l4_delta));
	} else if (proto == IPPROTO_UDP) {
		/* Zero stays zero: "no checksum" (v4) or a tunnel's zero checksum (v6). */
		__u16 c = get16(l4 + 6);
		if (c != 0) {
			c = csum_apply(c, l4_delta);
			put16(l4 + 6, c ? c : 0xffff);
		}
	} else {
		put16(l4 + 2, csum_apply(get16(l4 + 2), l4_delta));
	}
}

/* Up to userspace: the AF_XDP socket of this queue, or the kernel if none is bound. */
static __always_inline int to_userspace(struct xdp_md *ctx)
{
	return bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
}

SEC("xdp")
int pp_xdp(struct xdp_md *ctx)
{
	__u8 *data = (void *)(long)ctx->data;
	__u8 *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;
	struct xdp_node *node = bpf_map_lookup_elem(&node_config, &zero);

	if (!node || node->ip == 0)
		return XDP_PASS;

	__u8 *h = data;
	/* ESP (RFC 4303) to the node: the IPsec gateway's (docs/ipsec.md), in userspace,
	 * which also counts the short and malformed ones. */
	if (h + 34 <= data_end && h[12] == 0x08 && h[13] == 0x00 && (h[14] >> 4) == 4 &&
	    h[23] == IPPROTO_ESP && *(__u32 *)(h + 30) == node->ip)
		return to_userspace(ctx);

	/* Outer headers, the shape packet::vxlan_fast recognises: untagged IPv4 without
	 * options or fragmentation, UDP to 4789, VXLAN I flag. Anything else is not ours. */
	if (h + VXLAN_V4_OVERHEAD > data_end)
		return XDP_PASS;
	if (h[12] != 0x08 || h[13] != 0x00 || h[14] != 0x45 || h[23] != IPPROTO_UDP)
		return XDP_PASS;
	if (get16(h + 36) != VXLAN_PORT)
		return XDP_PASS;
	if (*(__u32 *)(h + 30) != node->ip)
		return XDP_PASS;
	__u32 *vm = bpf_map_lookup_elem(&vip_mode, &zero);
	if (vm && *vm) {
		__u64 dmac = 0;
		__builtin_memcpy(&dmac, h, 6);
		if (!bpf_map_lookup_elem(&vip_macs, &dmac))
			return XDP_PASS;
	}
	/* VXLAN to this node from here on: what this program does not run itself is the
	 * userspace pipeline's, which decides (and counts) drops. */
	__u64 frame_len = data_end - data;
	__u32 total = get16(h + 16);
	__u32 udp_len = get16(h + 38);
	if ((get16(h + 20) & 0x3fff) != 0 || total + ETH_HLEN > frame_len || udp_len < 16 ||
	    udp_len + 20 > total || (h[42] & 0x08) == 0)
		return to_userspace(ctx);
	__u32 inner_end = 34 + udp_len; /* the inner frame is [50, inner_end) */

	/* Inner Ethernet, untagged, IPv4 or IPv6. The checks are
	 * packet::parse's, on the inner frame [50, inner_end): a packet they would refuse
	 * goes up, so userspace refuses (and counts) it. */
	__u8 *ih = data + VXLAN_V4_OVERHEAD;
	__u32 l3_off = VXLAN_V4_OVERHEAD + ETH_HLEN;
	if (ih + ETH_HLEN > data_end || l3_off > inner_end)
		return to_userspace(ctx);
	__u16 inner_type = get16(ih + 12);
	__u8 *ip = ih + ETH_HLEN;
	struct flow_key key = {};
	__u8 proto;
	__u32 l4_len;
	__u8 *l4;
	int v6;
	if (inner_type == 0x0800) {
		v6 = 0;
		if (ip + 20 > data_end || l3_off + 20 > inner_end)
			return to_userspace(ctx);
		if ((ip[0] >> 4) != 4)
			return to_userspace(ctx);
		__u32 hl = (ip[0] & 0x0f) * 4;
		__u32 ip_total = get16(ip + 2);
		if (hl < 20 || ip_total < hl || l3_off + ip_total > inner_end)
			return to_userspace(ctx);
		/* Fragments (first ones included) stay on the userspace path. */
		if ((get16(ip + 6) & 0x3fff) != 0)
			return to_userspace(ctx);
		proto = ip[9];
		l4_len = ip_total - hl;
		l4 = ip + hl;
		key.src[10] = 0xff;
		key.src[11] = 0xff;
		__builtin_memcpy(&key.src[12], ip + 12, 4);
		key.dst[10] = 0xff;
		key.dst[11] = 0xff;
		__builtin_memcpy(&key.dst[12], ip + 16, 4);
	} else if (inner_type == 0x86dd) {
		v6 = 1;
		if (ip + 40 > data_end || l3_off + 40 > inner_end)
			return to_userspace(ctx);
		if ((ip[0] >> 4) != 6)
			return to_userspace(ctx);
		__u32 plen = get16(ip + 4);
		if (plen == 0 || l3_off + 40 + plen > inner_end)
			return to_userspace(ctx);
		/* v4-mapped addresses are refused by userspace (RFC 4942). */
		if (is_v4_mapped(ip + 8) || is_v4_mapped(ip + 24))
			return to_userspace(ctx);
		/* Extension headers, walked as packet::parse's walk_v6_ext does, up to
		 * MAX_V6_EXT in the driver; a fragment header (and any longer chain) goes
		 * up to userspace. */
		__u32 end = 40 + plen, off = 40;
		__u8 next = ip[6];
#pragma unroll
		for (int i = 0; i < MAX_V6_EXT; i++) {
			if (next != 0 && next != 43 && next != 60 && next != 51)
				break;
			/* Hop-by-Hop must come first (RFC 8200 §4.1). */
			if (next == 0 && i > 0)
				return to_userspace(ctx);
			if (off + 2 > end || off > MAX_V6_EXT_OFF)
				return to_userspace(ctx);
			__u8 *e = ip + off;
			if (e + 2 > data_end)
				return to_userspace(ctx);
			/* AH counts 4-byte units minus 2 (RFC 4302); the others 8-byte
			 * units minus 1. */
			__u32 len = next == 51 ? ((__u32)e[1] + 2) * 4 : ((__u32)e[1] + 1) * 8;
			if (off + len > end)
				return to_userspace(ctx);
			next = e[0];
			off += len;
		}
		proto = next;
		if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMPV6)
			return to_userspace(ctx);
		if (off > MAX_V6_EXT_OFF)
			return to_userspace(ctx);
		l4_len = end - off;
		l4 = ip + off;
		__builtin_memcpy(key.src, ip + 8, 16);
		__builtin_memcpy(key.dst, ip + 24, 16);
	} else {
		return to_userspace(ctx);
	}
	if (l4 + 8 > data_end) /* bounds for the verifier; lengths are checked below */
		return to_userspace(ctx);

	int sport_at = 0, dport_at = 2;
	if (proto == IPPROTO_TCP) {
		if (l4_len < 20 || l4 + 20 > data_end)
			return to_userspace(ctx);
		__u32 thl = (l4[12] >> 4) * 4;
		if (thl < 20 || thl > l4_len)
			return to_userspace(ctx);
	} else if (proto == IPPROTO_UDP) {
		if (l4_len < 8)
			return to_userspace(ctx);
		__u32 ulen = get16(l4 + 4);
		if (ulen < 8 || ulen > l4_len)
			return to_userspace(ctx);
		/* An inner VXLAN header would be parsed (and could be refused) by userspace. */
		if (get16(l4 + 2) == VXLAN_PORT)
			return to_userspace(ctx);
	} else if ((proto == IPPROTO_ICMP && !v6) || (proto == IPPROTO_ICMPV6 && v6)) {
		if (l4_len < 8)
			return to_userspace(ctx);
		__u8 t = l4[0];
		if (t == (v6 ? 128 : 8)) { /* echo request: the identifier is the source port */
			sport_at = 4;
			dport_at = -1;
		} else if (t == (v6 ? 129 : 0)) { /* echo reply: the destination port */
			sport_at = -1;
			dport_at = 4;
		} else {
			/* ICMP errors are keyed on their quote; not offloaded. */
			return to_userspace(ctx);
		}
	} else {
		return to_userspace(ctx);
	}
	if (sport_at >= 0) {
		key.sport[0] = l4[sport_at];
		key.sport[1] = l4[sport_at + 1];
	}
	if (dport_at >= 0) {
		key.dport[0] = l4[dport_at];
		key.dport[1] = l4[dport_at + 1];
	}
	key.vni[0] = h[46];
	key.vni[1] = h[47];
	key.vni[2] = h[48];
	key.proto = proto;

	struct xdp_rule *r = bpf_map_lookup_elem(&offloaded_rules, &key);
	if (!r)
		return to_userspace(ctx);

	/* Hit: one add each to the rule's counters, and its last-seen time for expiry. */
	__sync_fetch_and_add(&r->packets, 1);
	__sync_fetch_and_add(&r->bytes, frame_len);
	r->last_seen_ns = bpf_ktime_get_coarse_ns();

	__u32 f = r->flags;
	if (f & F_DROP)
		return XDP_DROP;

	if (f & (F_SRC_ADDR | F_SRC_PORT))
		rewrite_side(ip, l4, data_end, proto, v6, sport_at, f & F_SRC_ADDR, r->src_addr,
			     f & F_SRC_PORT, bswap16(r->sport), 0);
	if (f & (F_DST_ADDR | F_DST_PORT))
		rewrite_side(ip, l4, data_end, proto, v6, dport_at, f & F_DST_ADDR, r->dst_addr,
			     f & F_DST_PORT, bswap16(r->dport), 1);

	if (f & F_INNER_DMAC)
		__builtin_memcpy(ih, r->inner_dmac, 6);
	if (f & F_INNER_SMAC)
		__builtin_memcpy(ih + 6, r->inner_smac, 6);

	/* The rule's action list starts with decap (lib.rs refuses others): the output is
	 * the inner frame [50, inner_end), re-encapsulated when the rule says so. */
	if (frame_len > inner_end) {
		if (bpf_xdp_adjust_tail(ctx, (int)inner_end - (int)frame_len))
			return XDP_ABORTED;
	}
	if (!(f & F_ENCAP)) {
		if (bpf_xdp_adjust_head(ctx, VXLAN_V4_OVERHEAD))
			return XDP_ABORTED;
		return XDP_TX;
	}

	/* Re-encap in place: a fresh outer header over the old one (EncapV4::write). */
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	h = data;
	if (h + VXLAN_V4_OVERHEAD > data_end)
		return XDP_ABORTED;
	__u16 out_total = (__u16)(udp_len + 20);
	__builtin_memcpy(h, node->gw_mac, 6);
	__builtin_memcpy(h + 6, node->mac, 6);
	h[12] = 0x08;
	h[13] = 0x00;
	h[14] = 0x45;
	h[15] = 0;
	put16(h + 16, out_total);
	put16(h + 18, 0);
	h[20] = 0x40; /* DF */
	h[21] = 0;
	h[22] = 64;
	h[23] = IPPROTO_UDP;
	put16(h + 24, 0);
	__builtin_memcpy(h + 26, &node->ip, 4);
	__builtin_memcpy(h + 30, &r->encap_dst, 4);
	__u64 s = 0;
#pragma unroll
	for (int i = 0; i < 20; i += 2)
		s += get16(h + 14 + i);
	put16(h + 24, (__u16)~fold(s));
	put16(h + 34, bswap16(r->encap_sport));
	put16(h + 36, VXLAN_PORT);
	put16(h + 38, (__u16)udp_len);
	put16(h + 40, 0);
	h[42] = 0x08;
	h[43] = 0;
	h[44] = 0;
	h[45] = 0;
	h[46] = r->encap_vni[1];
	h[47] = r->encap_vni[2];
	h[48] = r->encap_vni[3];
	h[49] = 0;
	return XDP_TX;
}

char _license[] SEC("license") = "Dual BSD/GPL";
