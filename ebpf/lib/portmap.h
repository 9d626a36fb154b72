// SPDX-License-Identifier: GPL-2.0
/* Port mappings (portmap): the mapping a packet to a node address and
 * host port hits, whether a mapped flow's mapping still maps, and the IPv6
 * side (portmap6_in, portmap6_flow).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The IPv4 port mapping for a packet to daddr:dport: the mapping on
 * exactly that address first, then (if `wildcard`) the one on every node
 * address, unless that one is IPv6's only (DP_PM_V6_ONLY). */
static __always_inline struct dp_portmap_val *find_portmap(__u32 daddr, __u16 dport, __u8 proto,
							   int wildcard)
{
	struct dp_portmap_key pk = {.host_ip = daddr, .host_port = dport, .proto = proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (pm || !wildcard)
		return pm;
	pk.host_ip = 0;
	pm = bpf_map_lookup_elem(&portmap, &pk);
	return pm && !(pm->flags & DP_PM_V6_ONLY) ? pm : NULL;
}

/* Whether the mapping a flow the world opened (to the uplink's address)
 * came by still maps (host port, proto) to this sandbox's
 * `container_port` (network order): a converge that removed or moved it
 * ends the flow's exemption from the egress policy. A global function:
 * from_guest's frame is full. */
__noinline int portmap_live(__u32 uplink_ip, __u32 sandbox_ip, __u32 host_port, __u32 proto,
			    __u32 container_port)
{
	struct dp_portmap_val *pm = find_portmap(uplink_ip, (__u16)host_port, (__u8)proto, 1);
	return pm && pm->sandbox_ip == sandbox_ip && pm->container_port == (__u16)container_port;
}

/* Whether the mapping a flow the world opened came by still maps (host
 * port, proto) to this sandbox's `container_port` (network order): a
 * converge that removed or moved it ends the flow's exemption from the
 * egress policy. A global function: guest6_out's frame is full. */
__noinline int portmap6_live(__u32 sandbox_ip, __u32 host_port, __u32 proto, __u32 container_port)
{
	struct dp_portmap_key pk = {.host_port = (__u16)host_port, .proto = (__u8)proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	return pm && pm->sandbox_ip == sandbox_ip && pm->container_port == (__u16)container_port;
}

/* A world packet to the uplink's IPv6 address on a port mapped on every
 * node address (IPv6 has no per-address mappings): the flow to the
 * guest's current address (guest_fixed6), opened by this packet or
 * running, as from_uplink's for IPv4. NULL: the node's (no
 * such mapping; a host socket wins a new flow; a sandbox whose IPv6 does
 * not reach the world, whose guest has no route back: the node refuses,
 * and a client falls back to IPv4 at once). */
static __always_inline struct dp_tap *portmap6_in(struct __sk_buff *skb, const struct ip6h *ip,
						  const struct l4info *l4, struct dp_ct6_key *key)
{
	if (l4->proto == IPPROTO_ICMP)
		return NULL;
	struct dp_portmap_key pk = {.host_port = l4->dport, .proto = l4->proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (!pm)
		return NULL;
	__u32 sandbox_ip = pm->sandbox_ip;
	__u16 container_port = pm->container_port;
	int wins = pm->flags & DP_PM_WINS;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return NULL;
	__u32 ifindex = tap->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb || !(sb->flags & DP_F_V6_OUT))
		return NULL;
	__builtin_memset(key, 0, sizeof(*key));
	key->sandbox_ip = sandbox_ip;
	__builtin_memcpy(key->remote_ip, ip->saddr, 16);
	key->guest_port = container_port;
	key->remote_port = l4->sport;
	key->proto = l4->proto;
	struct dp_ct_val *v = ct6_to_guest(key, ifindex, tap->gen);
	if (v && (v->gen != tap->gen || v->kind != DP_CT_PORTMAP)) {
		/* An earlier owner's flow, or the guest's own from this port to
		 * this client: this packet opens a mapped flow. */
		drop_stale6(key, v);
		v = NULL;
	}
	if (opens_flow(v, l4) && !wins &&
	    host_socket6(skb, l4->proto, ip->saddr, l4->sport, ip->daddr, l4->dport)) {
		/* A host socket listens on (or is bound to) this port: the host
		 * wins for new flows, as for IPv4. */
		if (v)
			bpf_map_delete_elem(&ct6, key);
		count(DP_C_PORTMAP_HOST_SOCKET);
		return NULL;
	}
	if (v) {
		touch(skb, v, l4, DIR_IN);
	} else {
		struct dp_ct_val nv = {.nat_port = l4->dport, .kind = DP_CT_PORTMAP,
				       .gen = tap->gen};
		touch(skb, &nv, l4, DIR_IN);
		bpf_map_update_elem(&ct6, key, &nv, BPF_ANY);
		sb_count6(ifindex, DP_S_NEW_PORTMAP);
		flow_note(skb, ifindex, fe_what(DP_FE_START, 0, DP_FD_INGRESS, DP_FV_PORTMAP),
			  key->guest_port);
	}
	count(DP_C_PORTMAP);
	return tap;
}

/* The live flow of a port mapping on every node address whose packets to
 * the world have the tuple `rk` (sent from the uplink's IPv6 address and
 * the host port `rk->nat_port`): its key in `k` and its sandbox's TAP;
 * NULL when there is none. */
static __always_inline struct dp_tap *portmap6_flow(const struct dp_rev6_key *rk,
						    struct dp_ct6_key *k)
{
	struct dp_portmap_key pk = {.host_port = rk->nat_port, .proto = rk->proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (!pm)
		return NULL;
	__u32 sandbox_ip = pm->sandbox_ip;
	__builtin_memset(k, 0, sizeof(*k));
	k->sandbox_ip = sandbox_ip;
	__builtin_memcpy(k->remote_ip, rk->remote_ip, 16);
	k->guest_port = pm->container_port;
	k->remote_port = rk->remote_port;
	k->proto = rk->proto;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return NULL;
	struct dp_ct_val *v = ct6_to_guest(k, tap->ifindex, tap->gen);
	if (!v || v->gen != tap->gen || v->kind != DP_CT_PORTMAP || v->nat_port != rk->nat_port)
		return NULL;
	return tap;
}
