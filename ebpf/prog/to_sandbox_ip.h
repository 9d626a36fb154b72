// SPDX-License-Identifier: GPL-2.0
/* to_sandbox_ip: egress of the gateway device (host -> sandbox IP).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* host -> sandbox IP (routed into the gateway device): to the guest, from
 * the gateway, with a gateway-side port of its own (hflow). */
SEC("classifier")
int to_sandbox_ip(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		bpf_tail_call(skb, &tails, TAIL_HOST_TO_SANDBOX6);
		return TC_ACT_OK; /* not loaded: no host <-> sandbox over IPv6 */
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	__u32 dst = ip.daddr;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &dst);
	if (!tap)
		return TC_ACT_OK;
	/* Only the node's own packets reach a sandbox here: one the node
	 * forwards (a container's, a neighbour's with a route to the pool)
	 * came in on some device. */
	if (skb->ingress_ifindex) {
		count(DP_C_FORWARDED_DROP);
		return TC_ACT_SHOT;
	}
	if (l4.frag) {
		int rc = frag_follow(skb, c, &ip, &l4);
		return rc < 0 ? TC_ACT_SHOT : rc;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 peer = 0;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP && !host_admitted(skb)) {
		/* ICMP has no flows: every packet is judged (the kernel's own
		 * errors are root's). */
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	if (l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP) {
		struct dp_hflow_key hk = {
			.saddr = ip.saddr,
			.daddr = ip.daddr,
			.sport = l4.sport,
			.dport = l4.dport,
			.proto = l4.proto,
		};
		/* The agent's own services (resolver, proxy) answer flows the
		 * guest opened: with no such flow (a released sandbox's, whose
		 * address may have a new owner) the packet goes nowhere. */
		if (ip.saddr == c->host_ip && agent_service_port(&l4) &&
		    !hflow_of(c, &hk, dst, gen)) {
			count(DP_C_NO_ROUTE);
			return TC_ACT_SHOT;
		}
		/* A flow the node opens needs host access (a reply to a flow
		 * the guest opened has its entry). */
		__u16 gw_port;
		struct dp_hflow_val *flow;
		if (hflow_in(skb, c, &hk, dst, tap_ifindex, l4.dport, gen, DP_HF_GWDEV, 1, &l4,
			     &gw_port, &flow))
			return TC_ACT_SHOT;
		if (flow && flow->kind == DP_HF_PROXY)
			peer = flow->peer_ip;
		if (set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4))
			return TC_ACT_SHOT;
	}
	if (tap->flags & DP_T_PAUSED) {
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_PAUSED, DP_FD_HOST, DP_FV_FROM_NODE), 0);
		return paused_drop(tap_ifindex, gen, dst, ip.saddr,
				   wake_what(l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
					     l4.proto == IPPROTO_ICMP ? 0 : l4.sport, l4.proto,
					     DP_WAKE_HOST));
	}
	if (l4.first_frag)
		frag_note(&ip, tap_ifindex, gen, peer ? peer : c->gateway_ip, c->guest_ip);
	/* A proxied flow's replies come from the address the guest dialled. */
	if (set_addr(skb, IP_DST_OFF, ip.daddr, c->guest_ip, &l4) ||
	    set_addr(skb, IP_SRC_OFF, ip.saddr, peer ? peer : c->gateway_ip, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_TO_SANDBOX_IP);
	return bpf_redirect(tap_ifindex, 0);
}
