// SPDX-License-Identifier: GPL-2.0
/* guest6_steer (tail call of from_guest): a sandbox's IPv6 DNS, HTTP and
 * HTTPS to the agent's resolver and proxy.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* guest -> the IPv6 world on port 53, 80 or 443 from a sandbox with
 * domain rules or in strict mode (guest_ipv6 said V6_STEER; from_guest's
 * tail call): steer_to_agent's IPv6 twin. DNS (UDP/TCP 53) to anyone goes
 * to the agent's resolver, with or without IPv6 egress; with DP_F_SNI,
 * TCP to 80/443 that no allowed CIDR covers goes to the proxy and UDP to
 * 443 is dropped; with DP_F_RULES, TCP to 80/443 the policy lets out. The agent's sockets are reached through the node's side
 * of host <-> sandbox over IPv6 (pool6): without it a flow they should
 * take is refused (an RST, so the client falls back to IPv4), never sent
 * on. Anything else goes on to guest6_out. */
SEC("classifier")
int guest6_steer(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct ip6h ip;
	struct l4info l4;
	if (!c || !sb)
		return TC_ACT_SHOT;
	if (parse_ipv6(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	/* The replies of a flow the world opened to a port mapping are the
	 * mapped service's, not the guest's requests (as IPv4's). */
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4.sport,
		.remote_port = l4.dport,
		.proto = l4.proto,
		.gaddr = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__builtin_memcpy(key.remote_ip, ip.daddr, 16);
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	int mapped = v && v->kind == DP_CT_PORTMAP && v->gen == sb->gen &&
		     portmap6_live(sb->sandbox_ip, v->nat_port, l4.proto, l4.sport);
	int router = v6_router(c, ifindex);
	__u16 pport = 0;
	if (mapped) {
	} else if ((sb->flags & DP_F_DOMAINS) && l4.dport == bpf_htons(53) &&
		   (l4.proto == IPPROTO_UDP || l4.proto == IPPROTO_TCP)) {
		pport = bpf_htons(53);
	} else if (router && (sb->flags & DP_F_INTERNET) && (sb->flags & DP_F_RULES) &&
		   proxy_port(sb, &l4)) {
		/* Egress rules, as IPv4's steer_to_agent: every flow to 80/443
		 * whose SYN the policy lets out (guest6_out's test); a refused
		 * SYN goes on to guest6_out, which drops it. */
		if ((l4.tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN || (sb->flags & DP_F_SNI) ||
		    ((sb->flags & DP_F_V6_RULES)
			     ? policy6_allows(sb, (const struct dp_in6 *)ip.daddr, 1)
			     : v6_world(ip.daddr)))
			pport = proxy_port(sb, &l4);
	} else if (router &&
		   (sb->flags & (DP_F_SNI | DP_F_INTERNET)) == (DP_F_SNI | DP_F_INTERNET)) {
		struct dp_policy6_key pk = {.prefixlen = 160, .sandbox_ip = sb->sandbox_ip};
		__builtin_memcpy(pk.dst, ip.daddr, 16);
		if (!bpf_map_lookup_elem(&policy6_allow, &pk)) {
			pport = proxy_port(sb, &l4);
			if (!pport && l4.proto == IPPROTO_UDP && l4.dport == bpf_htons(443)) {
				count(DP_C_POLICY_DROP);
				sb_count6(ifindex, DP_S_POLICY);
				return refused6(skb, ifindex, DP_FR_POLICY); /* QUIC: clients fall back to TCP */
			}
		}
	}
	if (pport && pool6_on(c)) {
		int r = guest_to_proxy6(skb, c, sb, &ip, &l4, pport);
		if (r != PROXY_STALE)
			return r;
		count(DP_C_STALE_TCP);
		sb_count6(ifindex, DP_S_STALE_TCP);
		flow_note(skb, ifindex, FE_REFUSED(DP_FR_STALE_TCP), 0);
		skb->cb[0] = 0;
		bpf_tail_call(skb, &tails, TAIL_GUEST6_RST);
		return TC_ACT_SHOT;
	}
	if (!pport && router)
		bpf_tail_call(skb, &tails, TAIL_GUEST6_OUT);
	return answer6(skb, V6_REFUSE);
}
