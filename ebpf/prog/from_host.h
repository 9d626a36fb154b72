// SPDX-License-Identifier: GPL-2.0
/* from_host: egress of lo (the node's own connections to a mapped port).
 * Part of datapath.bpf.c's one translation unit (see there). */

SEC("classifier")
int from_host(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	/* A node process sending from a sandbox identity (IP_FREEBIND and
	 * IPV6_FREEBIND need no capability): only the datapath delivers such
	 * sources (into the gateway device, never through lo), so the agent's
	 * resolver and proxy, the node's services and the kernel's answers
	 * never take a local user for a sandbox. */
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		if (forged6(skb))
			return TC_ACT_SHOT;
		return TC_ACT_OK;
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	if (sandbox_source(c, ip.saddr)) {
		count(DP_C_FORGED_SOURCE);
		return TC_ACT_SHOT;
	}
	if (l4.frag || l4.first_frag || (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP))
		return TC_ACT_OK;
	/* Everything leaving through lo is addressed to the node itself. A
	 * mapping on exactly the destination address matches; a wildcard one
	 * only for 127.0.0.0/8 (first byte in network order) and the uplink
	 * address. */
	int wildcard = (ip.daddr & 0xff) == 127 || (c->uplink_ip && ip.daddr == c->uplink_ip);
	struct dp_portmap_val *pm = find_portmap(ip.daddr, l4.dport, l4.proto, wildcard);
	if (!pm)
		return TC_ACT_OK;
	__u32 sandbox_ip = pm->sandbox_ip;
	__u16 container_port = pm->container_port;
	int wins = pm->flags & DP_PM_WINS;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return TC_ACT_OK;
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 tap_flags = tap->flags;
	struct dp_hflow_key hk = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = l4.sport,
		.dport = l4.dport,
		.proto = l4.proto,
	};
	struct dp_hflow_val *hv = hflow_of(c, &hk, sandbox_ip, gen);
	int opens = !hv || (l4.proto == IPPROTO_TCP &&
			    (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN);
	if (opens && !wins &&
	    host_socket(skb, l4.proto, ip.saddr, l4.sport, ip.daddr, l4.dport, 1)) {
		/* A host socket listens there: the host wins (new flows). */
		if (hv)
			hflow_drop(c, &hk, hv);
		count(DP_C_PORTMAP_HOST_SOCKET);
		return TC_ACT_OK;
	}
	/* A port mapping is open to every local process (as one on a node
	 * address is to the world): no host-access check, the share only. */
	__u16 gw_port;
	struct dp_hflow_val *flow;
	if (hflow_in(skb, c, &hk, sandbox_ip, tap_ifindex, container_port, gen, DP_HF_LO, 0, &l4,
		     &gw_port, &flow))
		return TC_ACT_SHOT;
	if (tap_flags & DP_T_PAUSED) {
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_PAUSED, DP_FD_HOST, DP_FV_FROM_NODE),
			  container_port);
		return paused_drop(tap_ifindex, gen, sandbox_ip, ip.saddr,
				   wake_what(container_port, l4.sport, l4.proto, DP_WAKE_HOST));
	}
	if (set_addr(skb, IP_DST_OFF, ip.daddr, c->guest_ip, &l4) ||
	    set_addr(skb, IP_SRC_OFF, ip.saddr, c->gateway_ip, &l4) ||
	    set_port(skb, dst_port_off(&l4), l4.dport, container_port, &l4) ||
	    set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_LOCAL);
	return bpf_redirect(tap_ifindex, 0);
}
