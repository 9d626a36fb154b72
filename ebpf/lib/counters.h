// SPDX-License-Identifier: GPL-2.0
/* Counters: the global ones (counters, enum dp_counter), a sandbox's own
 * (sb_stats, enum dp_sb_counter) and its IPv6 traffic (sb_traffic6).
 * Part of datapath.bpf.c's one translation unit (see there). */

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	if (v)
		*v += 1;
}

/* One of a sandbox's own counters (see enum dp_sb_counter): a lookup and
 * an atomic add, on drop and new-flow paths only. */
static __always_inline void sb_count(__u32 ifindex, __u32 which)
{
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (s && which < DP_S_MAX)
		__sync_fetch_and_add(&s->c[which], 1);
}

/* sb_count for an IPv6 packet: the total and the IPv6 part. */
static __always_inline void sb_count6(__u32 ifindex, __u32 which)
{
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (s && which < DP_S_MAX) {
		__sync_fetch_and_add(&s->c[which], 1);
		__sync_fetch_and_add(&s->v6[which], 1);
	}
}

/* sb_count or sb_count6 by a host flow's family (DP_HFAM_*). */
static __always_inline void sb_count_fam(__u32 ifindex, __u32 which, __u8 family)
{
	if (family == 6)
		sb_count6(ifindex, which);
	else
		sb_count(ifindex, which);
}

/* One IPv6 frame of `len` bytes the sandbox on `ifindex` sent (`rx` 0) or
 * is sent (`rx` 1): sb_traffic6 (whose entry the agent made with the
 * sandbox's sb_stats entry). A global function: its frame is its own. */
__noinline int traffic6(__u32 ifindex, __u32 rx, __u32 len)
{
	struct dp_traffic6 *t = bpf_map_lookup_elem(&sb_traffic6, &ifindex);
	if (!t)
		return 0;
	if (rx) {
		t->rx_bytes += len;
		t->rx_packets += 1;
	} else {
		t->tx_bytes += len;
		t->tx_packets += 1;
	}
	return 0;
}

/* An IPv6 frame to the sandbox on `ifindex`, counted. */
static __always_inline int to_guest6(struct __sk_buff *skb, __u32 ifindex)
{
	traffic6(ifindex, 1, skb->len);
	return bpf_redirect(ifindex, 0);
}
