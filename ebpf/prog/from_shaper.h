// SPDX-License-Identifier: GPL-2.0
/* from_shaper: ingress of the shaper device's peer (a limited sandbox's
 * traffic to the world, released by its class, out of the uplink).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Ingress of the shaper device's peer: a limited sandbox's packet to the
 * world, translated by from_guest and released by its HTB class, goes on
 * out of the uplink. Nothing else is accepted here. */
SEC("classifier")
int from_shaper(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_SHOT;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_SHOT;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6) && (c->flags & DP_CFG_IPV6_EGRESS)) {
		struct ip6h ip6;
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) ||
		    !v6_eq(ip6.saddr, c->uplink_ip6))
			return TC_ACT_SHOT;
		skb->priority = 0;
		return forward_out6(skb, c, ip6.daddr, ip6.nexthdr);
	}
	if (!c->uplink_ip || eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_SHOT;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4) || ip.saddr != c->uplink_ip)
		return TC_ACT_SHOT;
	skb->priority = 0;
	return forward_out(skb, c, ip.daddr, ip.tos, ip.protocol);
}
