// SPDX-License-Identifier: GPL-2.0
/* from_uplink: ingress of the uplink (uplink_in: SNAT replies, port-mapped
 * flows, their fragments; replies of host connections moved off a
 * sandbox flow's tuple).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* A reply to a host connection that to_uplink moved off a sandbox flow's
 * tuple gets its own port back; the host's stack takes it from there. */
static __always_inline int host_nat_reply(struct __sk_buff *skb, const struct dp_rev_key *rk,
					  const struct dp_rev_val *rv, const struct l4info *l4)
{
	struct dp_rev_key hk = {
		.remote_ip = rk->remote_ip,
		.remote_port = rk->remote_port,
		.nat_port = rv->guest_port,
		.proto = rk->proto,
	};
	struct dp_ct_val *hv = bpf_map_lookup_elem(&host_nat, &hk);
	if (!hv || hv->nat_port != rk->nat_port) {
		bpf_map_delete_elem(&ct_rev, rk);
		return TC_ACT_OK;
	}
	touch(skb, hv, l4, DIR_IN);
	if (set_port(skb, dst_port_off(l4), rk->nat_port, hk.nat_port, l4))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* from_uplink's IPv4 part for a packet to the uplink's address: a reply
 * of a sandbox flow, a mapped flow, a fragment of either; TC_ACT_OK for
 * the host's own. */
static __always_inline int uplink_in(struct __sk_buff *skb, const struct dp_config *c,
				     struct iphdr *ip, struct l4info *l4)
{
	if (l4->frag) {
		int rc = frag_follow(skb, c, ip, l4);
		return rc < 0 ? TC_ACT_OK : rc;
	}
	if (l4->proto == IPPROTO_ICMP &&
	    (l4->icmp_type == ICMP_DEST_UNREACH || l4->icmp_type == ICMP_TIME_EXCEEDED ||
	     l4->icmp_type == ICMP_PARAMETERPROB))
		return icmp_error_in(skb);
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP_ECHOREPLY))
		return TC_ACT_OK;

	__u32 sandbox_ip;
	__u16 guest_port;
	struct dp_tap *tap;
	struct dp_rev_key rk = {
		.remote_ip = ip->saddr,
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->sport,
		.nat_port = l4->dport,
		.proto = l4->proto,
	};
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
	if (rv && rv->sandbox_ip == 0)
		return host_nat_reply(skb, &rk, rv, l4);
	if (rv) {
		sandbox_ip = rv->sandbox_ip;
		guest_port = rv->guest_port;
		__u64 gen = rv->gen;
		struct dp_ct_key key = {
			.sandbox_ip = sandbox_ip,
			.remote_ip = ip->saddr,
			.guest_port = guest_port,
			.remote_port = rk.remote_port,
			.proto = l4->proto,
		};
		struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
		if (!v || v->gen != gen || v->nat_port != rk.nat_port || v->kind != DP_CT_SNAT) {
			/* The forward entry was reaped (or is another flow's
			 * now): the flow is over. */
			bpf_map_delete_elem(&ct_rev, &rk);
			return TC_ACT_OK;
		}
		tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
		if (!tap || tap->gen != gen) {
			/* The flow of a released sandbox, or of an earlier owner
			 * of this address: never delivered to the new owner. */
			drop_stale(&key, v);
			return TC_ACT_OK;
		}
		/* A live sandbox flow owns its tuple: no host socket can take
		 * its replies (to_uplink moves a host connection that would
		 * use the same tuple to another port). */
		touch(skb, v, l4, DIR_IN);
		count(DP_C_SNAT_REPLY);
	} else {
		if (l4->proto == IPPROTO_ICMP)
			return TC_ACT_OK;
		/* daddr is the uplink address: the mapping on exactly it, or on
		 * every node address. Loopback mappings never match here. */
		struct dp_portmap_val *pm = find_portmap(ip->daddr, l4->dport, l4->proto, 1);
		if (!pm)
			return TC_ACT_OK; /* the host's own traffic */
		sandbox_ip = pm->sandbox_ip;
		guest_port = pm->container_port;
		tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
		if (!tap)
			return TC_ACT_SHOT;
		struct dp_ct_key key = {
			.sandbox_ip = sandbox_ip,
			.remote_ip = ip->saddr,
			.guest_port = guest_port,
			.remote_port = l4->sport,
			.proto = l4->proto,
		};
		struct dp_ct_val *v = flow_of(&key, tap->gen);
		if (opens_flow(v, l4) && !(pm->flags & DP_PM_WINS) &&
		    host_socket(skb, l4->proto, ip->saddr, l4->sport, ip->daddr, l4->dport, 1)) {
			/* A host socket listens on (or is bound to) this port: the
			 * host wins for new flows; mapped flows already running
			 * keep going. */
			if (v)
				bpf_map_delete_elem(&ct, &key);
			count(DP_C_PORTMAP_HOST_SOCKET);
			return TC_ACT_OK;
		}
		if (v) {
			touch(skb, v, l4, DIR_IN);
		} else {
			struct dp_ct_val nv = {.nat_port = l4->dport, .kind = DP_CT_PORTMAP,
					       .gen = tap->gen};
			touch(skb, &nv, l4, DIR_IN);
			bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
			sb_count(tap->ifindex, DP_S_NEW_PORTMAP);
			flow_note(skb, tap->ifindex,
				  fe_what(DP_FE_START, 0, DP_FD_INGRESS, DP_FV_PORTMAP), guest_port);
		}
		count(DP_C_PORTMAP);
	}
	__u32 tap_ifindex = tap->ifindex;
	if (tap->flags & DP_T_PAUSED) {
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_PAUSED, DP_FD_INGRESS, DP_FV_NONE), guest_port);
		return paused_drop(tap_ifindex, tap->gen, sandbox_ip, ip->saddr,
				   wake_what(guest_port, rk.remote_port, l4->proto,
					     rv ? DP_WAKE_REPLY : DP_WAKE_PORTMAP));
	}
	if (tap->flags & DP_T_SHAPE_IN)
		skb->priority = skb->len <= DP_SHAPE_SMALL ? DP_TAP_CLASS_SMALL : DP_TAP_CLASS_BULK;
	if (l4->first_frag)
		frag_note(ip, tap_ifindex, tap->gen, ip->saddr, c->guest_ip);
	if (set_addr(skb, IP_DST_OFF, ip->daddr, c->guest_ip, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, guest_port, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	return bpf_redirect(tap_ifindex, 0);
}

SEC("classifier")
int from_uplink(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		/* A sandbox identity or the guests' link as the source: forged
		 * (the node would answer it into the sandbox as its own). */
		if (forged6(skb))
			return TC_ACT_SHOT;
		if (c->flags & DP_CFG_IPV6_EGRESS)
			bpf_tail_call(skb, &tails, TAIL_UPLINK6_IN);
		return TC_ACT_OK;
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	int hairpin = skb->mark == DP_HAIRPIN_MARK;
	if (hairpin) {
		skb->mark = 0;
	} else if (sandbox_source(c, ip.saddr)) {
		count(DP_C_FORGED_SOURCE);
		return TC_ACT_SHOT;
	}
	if (!c->uplink_ip || ip.daddr != c->uplink_ip)
		return hairpin ? TC_ACT_SHOT : TC_ACT_OK;
	int rc = uplink_in(skb, c, &ip, &l4);
	if (hairpin && rc == TC_ACT_OK) {
		/* Not a mapped flow or its reply: never the host's. */
		count(DP_C_NODE_ADDR);
		return TC_ACT_SHOT;
	}
	return rc;
}
