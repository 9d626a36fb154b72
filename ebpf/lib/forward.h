// SPDX-License-Identifier: GPL-2.0
/* Out of the uplink: FIB lookup and next hop (or the hairpin back into
 * the uplink's ingress), IPv4 and IPv6.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Sends a translated packet out of the uplink (FIB lookup, next hop).
 * Inlined: on every packet of every flow to the world (as a global
 * function it cost ~10 % more per packet in cube-dpbench). */
static __always_inline int forward_out(struct __sk_buff *skb, const struct dp_config *c,
				       __u32 daddr, __u32 tos, __u32 protocol)
{
	if (daddr == c->uplink_ip) {
		/* Hairpin: a flow to a mapping at the node's own address (or a
		 * reply to one) turns around into the uplink's ingress, as if
		 * the router sent it back; from_uplink knows it by the mark.
		 * guest_to_world lets no other flow to the node come here. */
		skb->mark = DP_HAIRPIN_MARK;
		count(DP_C_HAIRPIN);
		return bpf_redirect(c->uplink_ifindex, BPF_F_INGRESS);
	}
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET;
	fib.tos = tos;
	fib.l4_protocol = protocol;
	/* tot_len 0: the kernel checks the MTU with is_skb_forwardable(),
	 * which knows GSO packets (their tot_len is the whole super-packet). */
	fib.tot_len = 0;
	fib.ipv4_src = c->uplink_ip;
	fib.ipv4_dst = daddr;
	fib.ifindex = c->uplink_ifindex;
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (set_macs(skb, fib.dmac, fib.smac))
			return TC_ACT_SHOT;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		/* No neighbour entry yet: let the kernel resolve it. */
		struct bpf_redir_neigh nh = {
			.nh_family = AF_INET,
			.ipv4_nh = fib.ipv4_dst,
		};
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED) {
		/* IPv4 forwarding is off on the uplink (the agent does not
		 * change host sysctls): the kernel routes and resolves the
		 * next hop itself, out of the uplink. */
		return bpf_redirect_neigh(c->uplink_ifindex, NULL, 0, 0);
	}
	count(DP_C_NO_ROUTE);
	sb_count(skb->ifindex, DP_S_NO_ROUTE);
	return TC_ACT_SHOT;
}

/* Out of the uplink to `daddr` (see forward_out). */
static __always_inline int forward_out6(struct __sk_buff *skb, const struct dp_config *c,
					const __u32 *daddr, __u8 proto)
{
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET6;
	fib.l4_protocol = proto;
	fib.tot_len = 0;
	__builtin_memcpy(fib.ipv6_src, c->uplink_ip6, 16);
	__builtin_memcpy(fib.ipv6_dst, daddr, 16);
	fib.ifindex = c->uplink_ifindex;
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (set_macs(skb, fib.dmac, fib.smac))
			return TC_ACT_SHOT;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {.nh_family = AF_INET6};
		__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16);
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED)
		return bpf_redirect_neigh(c->uplink_ifindex, NULL, 0, 0);
	count(DP_C_NO_ROUTE);
	sb_count6(skb->ifindex, DP_S_NO_ROUTE);
	return TC_ACT_SHOT;
}
