// SPDX-License-Identifier: GPL-2.0
/* uplink6_in (tail call of from_uplink): the IPv6 world -> a NAT66 flow's
 * or a port mapping's guest (uplink6_deliver, which uplink6_frag shares).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The world's packet `ip`/`l4` to the uplink's IPv6 address: a NAT66
 * flow's reply or a port mapping's, to its guest; else the node's. With
 * `frag` (the first fragment of a datagram), its later fragments are sent
 * after it (frags6). */
static __always_inline int uplink6_deliver(struct __sk_buff *skb, const struct dp_config *c,
					   const struct ip6h *ip, struct l4info *l4,
					   const struct dp_frag6_key *frag)
{
	if (l4->proto == IPPROTO_ICMP && l4->icmp_type >= ICMP6_DST_UNREACH &&
	    l4->icmp_type <= ICMP6_PARAM_PROB)
	{
		bpf_tail_call(skb, &tails, TAIL_ICMP6_ERROR);
		return TC_ACT_OK;
	}
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP6_ECHO_REPLY))
		return TC_ACT_OK;
	struct dp_rev6_key rk = {
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->sport,
		.nat_port = l4->dport,
		.proto = l4->proto,
	};
	__builtin_memcpy(rk.remote_ip, ip->saddr, 16);
	struct dp_ct6_key key;
	struct dp_ct_val *v;
	struct dp_tap *tap = nat66_flow(&rk, &key, &v);
	__u8 wake = DP_WAKE_REPLY;
	if (tap) {
		touch(skb, v, l4, DIR_IN);
		count(DP_C_NAT66_REPLY);
	} else {
		tap = portmap6_in(skb, ip, l4, &key);
		if (!tap)
			return TC_ACT_OK; /* the node's own */
		wake = DP_WAKE_PORTMAP;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u16 guest_port = key.guest_port;
	if (tap->flags & DP_T_PAUSED) {
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_PAUSED, DP_FD_INGRESS, DP_FV_NONE), guest_port);
		return paused_drop6(tap_ifindex, tap->gen, key.sandbox_ip,
				    (const struct dp_in6 *)rk.remote_ip,
				    wake_what(guest_port, rk.remote_port, l4->proto, wake));
	}
	if (tap->flags & DP_T_SHAPE_IN)
		skb->priority = skb->len <= DP_SHAPE_SMALL ? DP_TAP_CLASS_SMALL : DP_TAP_CLASS_BULK;
	__u32 guest[4];
	v6_guest_addr(guest, key.gaddr, c);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip->daddr, guest,
		      l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, guest_port, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	if (frag) {
		struct dp_frag6_val fv = {
			.first_seen_ns = bpf_ktime_get_ns(),
			.gen = tap->gen,
			.ifindex = tap_ifindex,
			.gaddr = key.gaddr,
		};
		bpf_map_update_elem(&frags6, frag, &fv, BPF_ANY);
	}
	return to_guest6(skb, tap_ifindex);
}

/* the IPv6 world -> a NAT66 flow's guest (from_uplink's tail call): the
 * reply side of guest6_out. Anything else is the node's own. */
SEC("classifier")
int uplink6_in(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_OK;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4) || !v6_eq(ip.daddr, c->uplink_ip6))
		return TC_ACT_OK;
	if (ip.nexthdr == IPPROTO_FRAGMENT) {
		bpf_tail_call(skb, &tails, TAIL_UPLINK6_FRAG);
		return TC_ACT_OK;
	}
	return uplink6_deliver(skb, c, &ip, &l4, NULL);
}
