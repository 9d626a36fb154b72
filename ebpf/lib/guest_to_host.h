// SPDX-License-Identifier: GPL-2.0
/* guest -> the gateway (169.254.68.5, fd63:7562:6500::5): the reply side
 * of a host flow, or a flow the guest opens to the node, delivered into the
 * gateway device (guest_to_gateway, guest_to_host6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The host flow of a guest's TCP or UDP packet to its gateway (address
 * family `family`, DP_HFAM_*): the reply side of a flow the host opened
 * (its hrev entry), else a flow the guest opens to the node, made here
 * (the node sees sandbox address -> gateway-device address, the guest's
 * ports kept). Its key in `hk` and kind in `kind`; -1: dropped. */
static __always_inline int guest_host_flow(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb, const struct l4info *l4,
					   __u8 family, __u16 flags, struct dp_hflow_key *hk,
					   __u8 *kind)
{
	struct dp_hrev_key rk = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4->sport,
		.gw_port = l4->dport,
		.proto = l4->proto,
		.family = family,
	};
	struct dp_hflow_val *hv = NULL;
	struct dp_hrev_val *rv = bpf_map_lookup_elem(&hrev, &rk);
	if (rv && rv->gen == sb->gen) {
		*hk = rv->host;
		hv = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
		if (hv && (hv->guest_port != l4->sport || hv->gw_port != l4->dport))
			hv = NULL;
	}
	if (hv) {
		hv->last_seen_ns = bpf_ktime_get_ns();
		hv->state = tcp_state(hv->state, l4, DIR_OUT);
		*kind = hv->kind;
		return 0;
	}
	if (rv)
		bpf_map_delete_elem(&hrev, &rk);
	/* A TCP segment other than a SYN of a flow nobody has (one the host
	 * opened, whose entries are gone) is not a flow the guest opens:
	 * made one, the host would answer it with a reset, or another socket
	 * of the host would get it. */
	if (l4->proto == IPPROTO_TCP && (l4->tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		count(DP_C_NO_HOST_FLOW);
		return -1;
	}
	/* A flow the guest opens: the host sees sandbox address -> gateway-
	 * device address, ports as the guest chose them. */
	hk->saddr = c->host_ip;
	hk->daddr = sb->sandbox_ip;
	hk->sport = l4->dport;
	hk->dport = l4->sport;
	hk->proto = l4->proto;
	hk->family = family;
	hk->pad[0] = hk->pad[1] = 0;
	struct dp_hflow_val *other = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
	if (other) {
		/* The host's tuple is another flow's (a host connection mapped
		 * to this guest port): taken over only by a SYN when that one
		 * is closed. */
		if (!(l4->proto == IPPROTO_TCP && tcp_closed(other->state))) {
			count(DP_C_NO_GW_PORT);
			sb_count_fam(skb->ifindex, DP_S_NO_PORT, family);
			return -1;
		}
		hflow_drop(c, hk, other);
	}
	if (guest_flow_new(skb, sb, hk, l4, DP_HF_GWDEV, flags, 0, NULL))
		return -1;
	struct dp_hrev_val nrv = {.host = *hk, .gen = sb->gen};
	bpf_map_update_elem(&hrev, &rk, &nrv, BPF_ANY);
	*kind = DP_HF_GWDEV;
	return 0;
}

/* guest -> 169.254.68.5. A reply of a host flow goes back exactly where
 * that flow came from (the sandbox IP via the gateway device, or a mapped
 * address via lo); anything else is a flow the guest opens to the host,
 * delivered as sandbox IP -> gateway-device IP with its ports kept. */
static __always_inline int guest_to_host(struct __sk_buff *skb, const struct dp_config *c,
					 const struct dp_sandbox *sb, const struct iphdr *ip,
					 const struct l4info *l4)
{
	__u8 kind = DP_HF_GWDEV;
	if (!l4->frag && !l4->first_frag &&
	    (l4->proto == IPPROTO_TCP || l4->proto == IPPROTO_UDP)) {
		struct dp_hflow_key hk;
		if (guest_host_flow(skb, c, sb, l4, DP_HFAM_IPV4, 0, &hk, &kind))
			return TC_ACT_SHOT;
		/* The host's tuple, reversed. */
		if (set_addr(skb, IP_SRC_OFF, ip->saddr, hk.daddr, l4) ||
		    set_addr(skb, IP_DST_OFF, ip->daddr, hk.saddr, l4) ||
		    set_port(skb, src_port_off(l4), l4->sport, hk.dport, l4) ||
		    set_port(skb, dst_port_off(l4), l4->dport, hk.sport, l4))
			return TC_ACT_SHOT;
	} else if (set_addr(skb, IP_SRC_OFF, ip->saddr, sb->sandbox_ip, l4) ||
		   set_addr(skb, IP_DST_OFF, ip->daddr, c->host_ip, l4)) {
		return TC_ACT_SHOT;
	}
	if (kind == DP_HF_LO) {
		__u8 zero[6] = {};
		if (set_macs(skb, zero, zero))
			return TC_ACT_SHOT;
		count(DP_C_LOCAL);
		return bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS);
	}
	return into_gwdev(skb, c);
}

/* guest_to_host as a global function: the verifier checks it once, and
 * from_guest's stack does not carry its locals (the call chain from_guest
 * -> steer_to_agent -> share_take must fit 512 bytes). */
__noinline int guest_to_gateway(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct iphdr ip;
	struct l4info l4;
	if (!sb || parse_ipv4(skb, &ip, &l4))
		return TC_ACT_SHOT;
	return guest_to_host(skb, c, sb, &ip, &l4);
}

/* guest -> fd63:7562:6500::5 (guest_ipv6 said V6_TO_HOST): as
 * guest_to_host, into the gateway device as sandbox_ipv6 -> the device's
 * IPv6 address; an echo reply (to the node's ping) with its addresses
 * only. */
__noinline int guest_to_host6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct ip6h ip;
	struct l4info l4;
	if (!sb || !pool6_on(c) || parse_ipv6(skb, &ip, &l4))
		return TC_ACT_SHOT;
	/* The proxy's ports take only what guest_to_proxy sends them (as
	 * from_guest's IPv4 check). */
	if (to_proxy_port(&l4)) {
		count(DP_C_POLICY_DROP);
		sb_count6(ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	struct dp_hflow_key hk = {};
	__u8 kind = DP_HF_GWDEV;
	int ports = l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP;
	__u16 fixed = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_HFF_GUEST_FIXED : 0;
	if (ports && guest_host_flow(skb, c, sb, &l4, DP_HFAM_IPV6, fixed, &hk, &kind))
		return TC_ACT_SHOT;
	if (kind != DP_HF_GWDEV) {
		/* Mapped ports through lo are IPv4's. */
		sb_count6(ifindex, DP_S_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	__u32 from[4], to[4];
	pool6_addr(from, c, sb->sandbox_ip);
	pool6_addr(to, c, c->host_ip);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip.saddr, from, &l4) ||
	    set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip.daddr, to, &l4))
		return TC_ACT_SHOT;
	if (ports && (set_port(skb, src_port_off(&l4), l4.sport, hk.dport, &l4) ||
		      set_port(skb, dst_port_off(&l4), l4.dport, hk.sport, &l4)))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}
