// SPDX-License-Identifier: GPL-2.0
/* from_guest: ingress of every sandbox TAP (and CNI veth host end); guest
 * -> world over IPv4 (guest_to_world: policy, SNAT, the reply side of a
 * port mapping); which IPv6 address the guest uses (learn_guest6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* guest -> world: SNAT after the policy check, or the reply side of a
 * port-mapped flow the world opened (admitted on the way in, so not
 * subject to the sandbox's egress policy). */
static __always_inline int guest_to_world(struct __sk_buff *skb, const struct dp_config *c,
					  const struct dp_sandbox *sb, const struct iphdr *ip,
					  const struct l4info *l4)
{
	/* Guest fragments are dropped: NAT needs every piece's ports. */
	if (!c->uplink_ip || l4->frag || l4->first_frag) {
		count(DP_C_NO_ROUTE);
		sb_count(skb->ifindex, DP_S_NO_ROUTE);
		return refused(skb, skb->ifindex, DP_FR_NO_ROUTE);
	}
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP_ECHO)) {
		sb_count(skb->ifindex, DP_S_UNSUPPORTED);
		return refused(skb, skb->ifindex, DP_FR_UNSUPPORTED);
	}

	struct dp_ct_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.remote_ip = ip->daddr,
		.guest_port = l4->sport,
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->dport,
		.proto = l4->proto,
	};
	__u16 nat_port;
	struct dp_ct_val *v = flow_of(&key, sb->gen);
	/* A flow the world opened to a mapping is exempt from the egress
	 * policy only while the mapping still names this sandbox and port. */
	if (v && v->kind == DP_CT_PORTMAP &&
	    !portmap_live(c->uplink_ip, sb->sandbox_ip, v->nat_port, l4->proto, l4->sport)) {
		drop_stale(&key, v);
		v = NULL;
	}
	/* Only DNS, HTTP and HTTPS may be steered: other flows pay two compares. */
	__u16 dp = l4->dport;
	if ((dp == bpf_htons(53) || dp == bpf_htons(80) || dp == bpf_htons(443)) &&
	    (sb->flags & (DP_F_SNI | DP_F_DOMAINS | DP_F_RULES)) && !(v && v->kind == DP_CT_PORTMAP)) {
		int r = steer_to_agent(skb);
		if (r == PROXY_STALE) {
			count(DP_C_STALE_TCP);
			sb_count(skb->ifindex, DP_S_STALE_TCP);
			flow_note(skb, skb->ifindex, FE_REFUSED(DP_FR_STALE_TCP), 0);
			return stale_reset(skb);
		}
		if (r == STEER_REFUSED)
			return refused(skb, skb->ifindex, DP_FR_POLICY);
		if (r != STEER_PASS)
			return r;
	}
	if (!(v && v->kind == DP_CT_PORTMAP) &&
	    (resolver_bypass(sb, l4) || !policy_allows(sb, ip->daddr, !v))) {
		count(DP_C_POLICY_DROP);
		sb_count(skb->ifindex, DP_S_POLICY);
		return refused(skb, skb->ifindex, DP_FR_POLICY);
	}
	/* The node's own addresses never by the uplink: its services are at
	 * the gateway (169.254.68.5); a mapping at the uplink's address is
	 * reached by hairpin (forward_out), as from the world; anything else
	 * to the node, loopback or the pool is dropped. */
	if (!v && node_dst(c, ip->daddr) &&
	    !(ip->daddr == c->uplink_ip && l4->proto != IPPROTO_ICMP &&
	      find_portmap(ip->daddr, l4->dport, l4->proto, 1))) {
		count(DP_C_NODE_ADDR);
		sb_count(skb->ifindex, DP_S_POLICY);
		return refused(skb, skb->ifindex, DP_FR_NODE_ADDR);
	}
	if (v) {
		touch(skb, v, l4, DIR_OUT);
		note_close(skb, v, l4);
		nat_port = v->nat_port;
	} else if (l4->proto == IPPROTO_TCP &&
		   (l4->tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		/* Not a SYN and no flow: an evicted live flow, or a stale one. */
		if (snat_rescue(&key, sb->gen, &nat_port)) {
			count(DP_C_STALE_TCP);
			sb_count(skb->ifindex, DP_S_STALE_TCP);
			flow_note(skb, skb->ifindex, FE_REFUSED(DP_FR_STALE_TCP), 0);
			return stale_reset(skb);
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = sb->gen};
		touch(skb, &nv, l4, DIR_OUT);
		bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
		count(DP_C_STALE_TCP_RESCUED);
	} else {
		struct syn_info si = {
			.syn = l4->proto == IPPROTO_TCP &&
			       (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4->tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, l4);
		if (snat_alloc(skb, &key, sb->gen, &si, &nat_port)) {
			count(DP_C_NO_PORT);
			sb_count(skb->ifindex, DP_S_NO_PORT);
			return refused(skb, skb->ifindex, DP_FR_NO_PORT);
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = sb->gen};
		touch(skb, &nv, l4, DIR_OUT);
		bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
		sb_count(skb->ifindex, DP_S_NEW_SNAT);
		flow_note(skb, skb->ifindex, fe_what(DP_FE_START, 0, DP_FD_EGRESS, DP_FV_SNAT),
			  nat_port);
	}
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, c->uplink_ip, l4) ||
	    set_port(skb, src_port_off(l4), l4->sport, nat_port, l4))
		return TC_ACT_SHOT;
	count(DP_C_SNAT);
	if ((sb->flags & DP_F_SHAPE_OUT) && c->shaper_ifindex) {
		__u32 ifindex = skb->ifindex;
		struct dp_rate *r = bpf_map_lookup_elem(&sb_rate, &ifindex);
		if (r && r->out_small) {
			/* Through the shaper; from_shaper sends it on. */
			skb->priority = skb->len <= DP_SHAPE_SMALL ? r->out_small : r->out_bulk;
			return bpf_redirect(c->shaper_ifindex, 0);
		}
	}
	return forward_out(skb, c, ip->daddr, ip->tos, ip->protocol);
}

/* Which of its two addresses the guest uses (sb_share.guest6), so that
 * flows others open to it go there (host <-> sandbox, port mappings): the
 * source of its IPv6 packets that may open something (all but TCP segments
 * after the SYN), or the target of its Duplicate Address
 * Detection (a guest configured statically claims fd63:7562:6500::6 at
 * link up, and may then stay silent until someone connects). Any other
 * source (link-local; a spoofed one, dropped further on) changes nothing,
 * and the entry is written only when it changes. A global function: its
 * stack is not from_guest's. */
__noinline int learn_guest6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return 0;
	/* A TCP segment other than a SYN is of a running flow: its address
	 * was learned when it opened (bulk data pays two byte loads, no map
	 * lookup). */
	__u8 nh, flags;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, nexthdr), &nh, 1))
		return 0;
	if (nh == IPPROTO_TCP &&
	    (bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(struct ip6h) + 13, &flags, 1) ||
	     (flags & 0x12) != 0x02))
		return 0;
	__u32 a[4];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), a, 16))
		return 0;
	if (!(a[0] | a[1] | a[2] | a[3])) {
		/* From "::": a Neighbor Solicitation's target is the address
		 * claimed. */
		struct {
			__u8 type, code;
			__u16 csum;
			__u32 reserved;
			__u32 target[4];
		} ns;
		if (nh != IPPROTO_ICMPV6 ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(struct ip6h), &ns, sizeof(ns)) ||
		    ns.type != ND_NEIGHBOR_SOLICIT)
			return 0;
		__builtin_memcpy(a, ns.target, 16);
	}
	__u32 g;
	if (v6_fixed_eq(a, DP_V6_GUEST_LO))
		g = DP_SHARE_FIXED6;
	else if (v6_eui64_eq(a, DP_V6_PREFIX0, DP_V6_PREFIX1, c->guest_mac))
		g = 0;
	else
		return 0;
	__u32 ifindex = skb->ifindex;
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s && s->guest6 != g)
		s->guest6 = g;
	return 0;
}

SEC("classifier")
int from_guest(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb)
		return TC_ACT_SHOT; /* an idle pool TAP: nothing leaves it */

	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth))) {
		count(DP_C_MALFORMED);
		sb_count(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (!mac_eq(eth.h_source, c->guest_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return refused(skb, ifindex, DP_FR_SPOOFED);
	}
	if (eth.h_proto == bpf_htons(ETH_P_ARP))
		return proxy_arp(skb, c);
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		traffic6(ifindex, 0, skb->len);
		if (!(c->flags & DP_CFG_IPV6)) {
			sb_count6(ifindex, DP_S_UNSUPPORTED); /* ipv6 = "off" */
			return TC_ACT_SHOT;
		}
		learn_guest6(skb);
		int r = answer6(skb, V6_JUDGE);
		if (r == V6_TO_HOST)
			return guest_to_host6(skb);
		if (r == V6_STEER) {
			bpf_tail_call(skb, &tails, TAIL_GUEST6_STEER);
			return answer6(skb, V6_REFUSE); /* not loaded: refused */
		}
		if (r != V6_TO_WORLD)
			return r;
		bpf_tail_call(skb, &tails, TAIL_GUEST6_OUT);
		return answer6(skb, V6_REFUSE); /* not loaded: no egress */
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP)) {
		sb_count(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	/* Only the gateway is on the guest's link: no frame goes straight to
	 * another guest. */
	if (!mac_eq(eth.h_dest, c->gateway_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return refused(skb, ifindex, DP_FR_SPOOFED);
	}
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (ip.saddr != c->guest_ip) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return refused(skb, ifindex, DP_FR_SPOOFED);
	}
	if (ip.daddr == c->gateway_ip) {
		/* The proxy's ports take only what guest_to_proxy sends them. */
		if (to_proxy_port(&l4)) {
			count(DP_C_POLICY_DROP);
			sb_count(ifindex, DP_S_POLICY);
			return refused(skb, ifindex, DP_FR_POLICY);
		}
		return guest_to_gateway(skb);
	}
	if (l4.proto == IPPROTO_ICMP &&
	    (l4.icmp_type == ICMP_DEST_UNREACH || l4.icmp_type == ICMP_TIME_EXCEEDED ||
	     l4.icmp_type == ICMP_PARAMETERPROB))
		return icmp_error_out(skb);
	return guest_to_world(skb, c, sb, &ip, &l4);
}
