// SPDX-License-Identifier: GPL-2.0
/* to_uplink: egress of the uplink (the host's own connections in the SNAT
 * range, its IPv6 ones on a sandbox flow's tuple: to_uplink6; traffic for
 * the shaper).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The node's own IPv6 packet out of the uplink (to_uplink): on a tuple a
 * live sandbox flow holds, it would take that flow's replies, so it is
 * dropped (the SNAT range is the sandboxes'; snat6_alloc never takes a
 * tuple a node socket already has). */
__noinline int to_uplink6(struct __sk_buff *skb)
{
	/* A global function: verified once, apart from to_uplink's IPv4
	 * paths (together past the verifier's budget). */
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_OK;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4) || !v6_eq(ip.saddr, c->uplink_ip6))
		return TC_ACT_OK;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST))
		return TC_ACT_OK;
	__u16 port = bpf_ntohs(l4.sport);
	if (port < c->snat_port_min || port > c->snat_port_max)
		return TC_ACT_OK;
	/* A sandbox's packets passed in uplink_out already. */
	struct dp_rev6_key rk = {
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.nat_port = l4.sport,
		.proto = l4.proto,
	};
	__builtin_memcpy(rk.remote_ip, ip.daddr, 16);
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev6, &rk);
	if (!rv)
		return TC_ACT_OK;
	struct syn_info si = {
		.syn = l4.proto == IPPROTO_TCP && (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
		.seq = l4.tcp_seq,
	};
	if (si.syn)
		si.ts = tcp_tsval(skb, &l4);
	if (snat6_port_reusable(&rk, &si)) {
		bpf_map_delete_elem(&ct_rev6, &rk);
		return TC_ACT_OK;
	}
	count(DP_C_NAT66_HOST_HELD);
	return TC_ACT_SHOT;
}

/* The host's own traffic leaving the uplink (and what the host forwards,
 * e.g. netfilter-masqueraded containers): a connection whose source port
 * lies in the SNAT range takes its tuple in the same space as sandbox
 * flows (ct_rev), so a sandbox never gets its replies; if a live sandbox
 * flow holds the tuple already, the host connection leaves with another
 * port of the range instead (and from_uplink gives its replies their port
 * back), as conntrack does for clashing connections. Sandbox packets
 * (redirected here by from_guest, already translated) pass untouched. */
static __always_inline int uplink_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	/* A sandbox's packet (from_guest redirected it here, translated; or
	 * the shaper's peer sent it on) passes first, before any parsing:
	 * it passed at every later exit too (to_uplink6's as well). One map
	 * lookup per packet instead of three loads and the lookup (~2 % of
	 * a 64-byte UDP sender's CPU in cube-dpbench); the host's forwarded
	 * packets pay the lookup even outside the SNAT range. */
	__u32 iif = skb->ingress_ifindex;
	if (iif && (iif == c->shaper_peer_ifindex || bpf_map_lookup_elem(&sandboxes, &iif)))
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6))
		return (c->flags & DP_CFG_IPV6_EGRESS) ? to_uplink6(skb) : TC_ACT_OK;
	if (!c->uplink_ip || eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4) || l4.frag || ip.saddr != c->uplink_ip)
		return TC_ACT_OK;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP_ECHO))
		return TC_ACT_OK;
	__u16 port = bpf_ntohs(l4.sport);
	if (port < c->snat_port_min || port > c->snat_port_max)
		return TC_ACT_OK;
	struct dp_rev_key hk = {
		.remote_ip = ip.daddr,
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.nat_port = l4.sport,
		.proto = l4.proto,
	};
	__u16 out;
	struct dp_ct_val *hv = bpf_map_lookup_elem(&host_nat, &hk);
	if (hv) {
		touch(skb, hv, &l4, DIR_OUT);
		out = hv->nat_port;
	} else {
		struct dp_rev_val rv = {.sandbox_ip = 0, .guest_port = l4.sport, .gen = 0};
		struct syn_info si = {
			.syn = l4.proto == IPPROTO_TCP &&
			       (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4.tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, &l4);
		if (bpf_map_update_elem(&ct_rev, &hk, &rv, BPF_NOEXIST) == 0 ||
		    (snat_port_reusable(&hk, &si) &&
		     bpf_map_update_elem(&ct_rev, &hk, &rv, BPF_ANY) == 0)) {
			out = l4.sport;
		} else if (host_tuple_alloc(skb, &hk, port + ip.daddr * 2654435761u, &si, &out)) {
			/* The whole range is held to this remote endpoint: the
			 * connection keeps its port (as before this program). */
			return TC_ACT_OK;
		} else {
			count(DP_C_HOST_REMAP);
		}
		struct dp_ct_val nv = {.nat_port = out, .kind = DP_CT_HOST};
		touch(skb, &nv, &l4, DIR_OUT);
		bpf_map_update_elem(&host_nat, &hk, &nv, BPF_ANY);
	}
	if (out != l4.sport && set_port(skb, src_port_off(&l4), l4.sport, out, &l4))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* The uplink's egress: the host's own connections as above; then a
 * packet of the agent's own socket that carries a limited sandbox's
 * traffic to the world (strict mode's proxy) names the sandbox's class of
 * the shaper in its priority (only CAP_NET_ADMIN sets such a priority):
 * it goes through the shaper, whose peer (from_shaper, which clears the
 * priority) sends it on out of here. */
SEC("classifier")
int to_uplink(struct __sk_buff *skb)
{
	int rc = uplink_out(skb);
	if (rc == TC_ACT_OK && (skb->priority >> 16) == (DP_TAP_CLASS_BULK >> 16)) {
		struct dp_config *c = get_config();
		if (c && c->shaper_ifindex && skb->protocol == bpf_htons(ETH_P_IP))
			return bpf_redirect(c->shaper_ifindex, 0);
	}
	return rc;
}
