// SPDX-License-Identifier: GPL-2.0
/* guest6_out (tail call of from_guest and guest6_steer): guest -> the IPv6
 * world, NAT66.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* guest -> the IPv6 world (from_guest's tail call, after guest_ipv6 checked
 * the link: source, MACs, an off-link unicast destination, a sandbox with
 * DP_F_V6_OUT): the default denies, then NAT66 to the uplink's address
 * with a port of the SNAT range, as guest_to_world does for IPv4. */
SEC("classifier")
int guest6_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!c || !sb || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_SHOT;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (l4.proto == IPPROTO_ICMP && l4.icmp_type >= ICMP6_DST_UNREACH &&
	    l4.icmp_type <= ICMP6_PARAM_PROB) {
		/* An error about a flow it holds: translated in icmp6_error. */
		bpf_tail_call(skb, &tails, TAIL_ICMP6_ERROR);
		sb_count6(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST)) {
		sb_count6(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4.sport,
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.proto = l4.proto,
		.gaddr = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__builtin_memcpy(key.remote_ip, ip.daddr, 16);
	__u64 gen = sb->gen;
	__u16 nat_port;
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	if (v && (v->gen != gen ||
		  (v->kind == DP_CT_PORTMAP &&
		   !portmap6_live(sb->sandbox_ip, v->nat_port, l4.proto, l4.sport)))) {
		drop_stale6(&key, v);
		v = NULL;
	}
	/* The policy on every packet, as IPv4's (a changed rule stops a flow),
	 * but for the replies of a flow the world opened to a port mapping;
	 * DNS and DNS-over-TLS of a sandbox with domain rules go to the
	 * agent's resolver only, which is IPv4's: dropped here. */
	if (!(v && v->kind == DP_CT_PORTMAP) &&
	    (!(sb->flags & DP_F_INTERNET) || resolver_bypass(sb, &l4) ||
	    !((sb->flags & DP_F_V6_RULES)
		      ? policy6_allows(sb, (const struct dp_in6 *)ip.daddr, !v)
		      : v6_world(ip.daddr)))) {
		count(DP_C_POLICY_DROP);
		sb_count6(ifindex, DP_S_POLICY);
		return refused6(skb, ifindex, DP_FR_POLICY);
	}
	/* The node's own addresses never by the uplink (IPv6 has no hairpin:
	 * mappings are reached over IPv4's). */
	if (!v && node_dst6((const struct dp_in6 *)ip.daddr)) {
		count(DP_C_NODE_ADDR);
		sb_count6(ifindex, DP_S_POLICY);
		return refused6(skb, ifindex, DP_FR_NODE_ADDR);
	}
	if (v) {
		touch(skb, v, &l4, DIR_OUT);
		note_close(skb, v, &l4);
		nat_port = v->nat_port;
	} else if (l4.proto == IPPROTO_TCP &&
		   (l4.tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		if (snat6_rescue(&key, gen, &nat_port)) {
			count(DP_C_STALE_TCP);
			sb_count6(ifindex, DP_S_STALE_TCP);
			flow_note(skb, ifindex, FE_REFUSED(DP_FR_STALE_TCP), 0);
			/* Its RST, from guest_ipv6 (whose stack and this one's
			 * do not fit one call chain). */
			skb->cb[0] = 0;
			bpf_tail_call(skb, &tails, TAIL_GUEST6_RST);
			return TC_ACT_SHOT;
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = gen};
		touch(skb, &nv, &l4, DIR_OUT);
		bpf_map_update_elem(&ct6, &key, &nv, BPF_ANY);
		count(DP_C_STALE_TCP_RESCUED);
	} else {
		struct syn_info si = {
			.syn = l4.proto == IPPROTO_TCP &&
			       (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4.tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, &l4);
		if (snat6_alloc(skb, &key, gen, &si, &nat_port)) {
			count(DP_C_NO_PORT);
			sb_count6(ifindex, DP_S_NO_PORT);
			return refused6(skb, ifindex, DP_FR_NO_PORT);
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = gen};
		touch(skb, &nv, &l4, DIR_OUT);
		bpf_map_update_elem(&ct6, &key, &nv, BPF_ANY);
		sb_count6(ifindex, DP_S_NEW_SNAT);
		flow_note(skb, ifindex, fe_what(DP_FE_START, 0, DP_FD_EGRESS, DP_FV_SNAT), nat_port);
	}
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip.saddr,
		      c->uplink_ip6, &l4) ||
	    set_port(skb, src_port_off(&l4), l4.sport, nat_port, &l4))
		return TC_ACT_SHOT;
	count(DP_C_NAT66);
	if ((sb->flags & DP_F_SHAPE_OUT) && c->shaper_ifindex) {
		struct dp_rate *r = bpf_map_lookup_elem(&sb_rate, &ifindex);
		if (r && r->out_small) {
			skb->priority = skb->len <= DP_SHAPE_SMALL ? r->out_small : r->out_bulk;
			return bpf_redirect(c->shaper_ifindex, 0);
		}
	}
	return forward_out6(skb, c, ip.daddr, ip.nexthdr);
}
