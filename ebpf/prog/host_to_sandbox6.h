// SPDX-License-Identifier: GPL-2.0
/* host_to_sandbox6 (tail call of to_sandbox_ip): host -> a sandbox's IPv6
 * identity.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* host -> a sandbox's IPv6 identity (routed into the gateway device; to_
 * sandbox_ip's tail call: a program of its own, so that its stack is not
 * added to to_sandbox_ip's IPv4 one): only the node's own packets from the device's
 * address, TCP and UDP by host flow (the same admission as IPv4's: root
 * or host_access for a flow the node opens), echo requests of an admitted
 * sender; to the guest's address (the flow's, else its current one:
 * guest_fixed6) from fd63:7562:6500::5. */
SEC("classifier")
int host_to_sandbox6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !pool6_on(c))
		return TC_ACT_OK;
	struct l4info l4;
	__u32 dst;
	int from_device;
	{
		/* Scoped: the frame must fit to_sandbox_ip's in 512 bytes. */
		struct ip6h ip;
		if (parse_ipv6(skb, &ip, &l4) || ip.daddr[0] != c->pool6[0] ||
		    ip.daddr[1] != c->pool6[1] || ip.daddr[2] != c->pool6[2])
			return TC_ACT_OK;
		dst = ip.daddr[3];
		/* Only from the device's own address (another of the node's is
		 * not the flow's tuple). */
		from_device = ip.saddr[0] == c->pool6[0] && ip.saddr[1] == c->pool6[1] &&
			      ip.saddr[2] == c->pool6[2] && ip.saddr[3] == c->host_ip;
	}
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &dst);
	if (!tap)
		return TC_ACT_OK;
	if (skb->ingress_ifindex) {
		count(DP_C_FORWARDED_DROP);
		return TC_ACT_SHOT;
	}
	if (!from_device) {
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 tap_flags = tap->flags;
	struct dp_hflow_val *flow = NULL;
	if (l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP) {
		struct dp_hflow_key hk = {
			.saddr = c->host_ip,
			.daddr = dst,
			.sport = l4.sport,
			.dport = l4.dport,
			.proto = l4.proto,
			.family = DP_HFAM_IPV6,
		};
		/* As IPv4's: the agent's resolver and proxy answer only flows
		 * the address's current owner opened. */
		if (agent_service_port(&l4) && !hflow_of(c, &hk, dst, gen)) {
			count(DP_C_NO_ROUTE);
			return TC_ACT_SHOT;
		}
		__u16 gw_port;
		if (hflow_in(skb, c, &hk, dst, tap_ifindex, l4.dport, gen, DP_HF_GWDEV, 1, &l4,
			     &gw_port, &flow))
			return TC_ACT_SHOT;
		if (set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4))
			return TC_ACT_SHOT;
	} else if (!(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST) ||
		   !host_admitted(skb)) {
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	if (tap_flags & DP_T_PAUSED) {
		/* The sender: the gateway device's own IPv6 address. */
		struct dp_in6 from = {.w = {c->pool6[0], c->pool6[1], c->pool6[2], c->host_ip}};
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_PAUSED, DP_FD_HOST, DP_FV_FROM_NODE), 0);
		return paused_drop6(tap_ifindex, gen, dst, &from,
				    wake_what(l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
					      l4.proto == IPPROTO_ICMP ? 0 : l4.sport, l4.proto,
					      DP_WAKE_HOST));
	}
	__u32 old[4], a[4];
	pool6_addr(old, c, dst);
	/* To the guest address of the flow; a new one (or an echo) to the
	 * guest's current one. */
	int fixed = flow ? flow->flags & DP_HFF_GUEST_FIXED : guest_fixed6(tap_ifindex);
	v6_guest_addr(a, fixed ? DP_GADDR_FIXED : DP_GADDR_SLAAC, c);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), old, a, &l4))
		return TC_ACT_SHOT;
	pool6_addr(old, c, c->host_ip);
	/* A steered flow's replies come from the address the guest dialled. */
	if (flow && flow->kind == DP_HF_PROXY)
		__builtin_memcpy(a, flow->peer6, 16);
	else
		v6_fixed(a, DP_V6_GATEWAY_LO);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), old, a, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_TO_SANDBOX_IP);
	return to_guest6(skb, tap_ifindex);
}
