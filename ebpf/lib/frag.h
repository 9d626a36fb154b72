// SPDX-License-Identifier: GPL-2.0
/* IPv4 fragments: the first fragment of a datagram that goes to a
 * sandbox notes where (frags); the fragments after it follow.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* How long a fragment's first sibling is remembered (ipfrag_time). */
#define FRAG_TTL_NS (30ULL * 1000000000ULL)

/* The first fragment of a datagram that goes to a sandbox: the fragments
 * after it (no ports) follow it there, with the same addresses. */
static __always_inline void frag_note(const struct iphdr *ip, __u32 ifindex, __u64 gen,
				      __u32 new_saddr, __u32 new_daddr)
{
	struct dp_frag_key fk = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.id = ip->id,
		.proto = ip->protocol,
	};
	struct dp_frag_val fv = {
		.first_seen_ns = bpf_ktime_get_ns(),
		.gen = gen,
		.ifindex = ifindex,
		.new_saddr = new_saddr,
		.new_daddr = new_daddr,
	};
	bpf_map_update_elem(&frags, &fk, &fv, BPF_ANY);
}

/* A fragment after the first: where its first sibling went (still the same
 * sandbox's TAP), else -1 (the host's own, or its first sibling has not
 * arrived: the host's reassembly times out without an ICMP error). */
static __always_inline int frag_follow(struct __sk_buff *skb, const struct dp_config *c,
				       const struct iphdr *ip, const struct l4info *l4)
{
	struct dp_frag_key fk = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.id = ip->id,
		.proto = ip->protocol,
	};
	struct dp_frag_val *fv = bpf_map_lookup_elem(&frags, &fk);
	if (!fv || bpf_ktime_get_ns() - fv->first_seen_ns > FRAG_TTL_NS)
		return -1;
	__u32 ifindex = fv->ifindex;
	__u32 new_saddr = fv->new_saddr, new_daddr = fv->new_daddr;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb || sb->gen != fv->gen)
		return -1;
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, new_saddr, l4) ||
	    set_addr(skb, IP_DST_OFF, ip->daddr, new_daddr, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_FRAG);
	return bpf_redirect(ifindex, 0);
}
