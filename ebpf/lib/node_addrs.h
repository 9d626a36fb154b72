// SPDX-License-Identifier: GPL-2.0
/* The node's own addresses and forged sources: whether a sandbox's
 * packet is for the node itself (node_dst, node_dst6: node_addrs,
 * node_addrs6, the pool, loopback), and whether a source only the datapath
 * may send from arrives from elsewhere (sandbox_source, forged6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Whether `a` is a sandbox identity or on the guests' link: the pool (but
 * the gateway device's own address) or 169.254.68.4/30. Such a source
 * enters the node through the datapath only. */
static __always_inline int sandbox_source(const struct dp_config *c, __u32 a)
{
	if (a == c->host_ip)
		return 0;
	if (c->pool_mask && (a & c->pool_mask) == (c->host_ip & c->pool_mask))
		return 1;
	return (a & bpf_htonl(0xfffffffc)) == (c->gateway_ip & bpf_htonl(0xfffffffc));
}

/* Whether a sandbox's packet to `a` is for the node itself: loopback, an
 * address of the node's (node_addrs), or the pool (another sandbox's, or
 * the gateway device's). */
static __always_inline int node_dst(const struct dp_config *c, __u32 a)
{
	if ((a & 0xff) == 127 || a == c->uplink_ip)
		return 1;
	if (c->pool_mask && (a & c->pool_mask) == (c->host_ip & c->pool_mask))
		return 1;
	return bpf_map_lookup_elem(&node_addrs, &a) != NULL;
}

/* The same for IPv6 sources: an ipv6_pool identity (but the gateway
 * device's own address) or the guests' link fd63:7562:6500::/64. A global
 * function: its own frame. */
__noinline int sandbox_source6(const struct dp_in6 *a)
{
	struct dp_config *c = get_config();
	if (!c || !a)
		return 0;
	if (a->w[0] == bpf_htonl(DP_V6_PREFIX0) && a->w[1] == bpf_htonl(DP_V6_PREFIX1))
		return 1;
	if (!(c->pool6[0] | c->pool6[1] | c->pool6[2]))
		return 0;
	return a->w[0] == c->pool6[0] && a->w[1] == c->pool6[1] && a->w[2] == c->pool6[2] &&
	       a->w[3] != c->host_ip;
}

/* Whether an IPv6 packet arriving from outside the datapath (the uplink,
 * a node process through lo) has a sandbox identity or the guests' link as
 * its source: forged (counted). */
static __always_inline int forged6(struct __sk_buff *skb)
{
	struct dp_in6 src;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8 /* ipv6hdr.saddr */, &src,
			       sizeof(src)) ||
	    !sandbox_source6(&src))
		return 0;
	count(DP_C_FORGED_SOURCE);
	return 1;
}

/* Whether a sandbox's IPv6 packet to `a` is for the node itself: ::1, an
 * address of the node's (node_addrs6), an ipv6_pool identity. */
__noinline int node_dst6(const struct dp_in6 *a)
{
	struct dp_config *c = get_config();
	if (!c || !a)
		return 0;
	if (!a->w[0] && !a->w[1] && !a->w[2] && a->w[3] == bpf_htonl(1))
		return 1;
	if ((c->pool6[0] | c->pool6[1] | c->pool6[2]) && a->w[0] == c->pool6[0] &&
	    a->w[1] == c->pool6[1] && a->w[2] == c->pool6[2])
		return 1;
	struct dp_in6 k = *a;
	return bpf_map_lookup_elem(&node_addrs6, &k) != NULL;
}
