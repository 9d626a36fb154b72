// SPDX-License-Identifier: GPL-2.0
/* icmp6_error (tail call of uplink6_in and guest6_out): ICMPv6 errors
 * about translated flows, both ways.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* ICMPv6 errors about translated flows, both ways (a program of its own,
 * the tail call of uplink6_in and of guest6_out: its stack and theirs do
 * not fit one call chain).
 *
 * From a sandbox's TAP: icmp6_error_out. From the world: an error about a
 * packet of a NAT66 flow (quoted as sent: from the uplink's address and
 * the NAT port) or of a port-mapped flow (from the host port) goes to the
 * guest as if its own packet had met it, the outer destination, the
 * quoted source address and port and every checksum they touch
 * rewritten. Above all Packet Too Big: IPv6 routers never fragment, so
 * without it a guest's large packets vanish on any narrower link. Errors
 * about nothing a live sandbox holds go to the node. */
SEC("classifier")
int icmp6_error(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (sb)
		return c ? icmp6_error_out(skb, c, sb) : TC_ACT_SHOT;
	if (!c)
		return TC_ACT_OK;
	struct icmp6_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) ||
	    !v6_eq(h.in.saddr, c->uplink_ip6))
		return TC_ACT_OK;
	__u8 proto = h.in.nexthdr;
	int echo = proto == IPPROTO_ICMPV6;
	if (echo ? (h.l4[0] & 0xff) != ICMP6_ECHO_REQUEST
		 : proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return TC_ACT_OK;
	struct dp_rev6_key rk = {
		.remote_port = echo ? 0 : h.l4[1],
		.nat_port = echo ? h.l4[2] : h.l4[0],
		.proto = echo ? IPPROTO_ICMP : proto,
	};
	__builtin_memcpy(rk.remote_ip, h.in.daddr, 16);
	struct dp_ct6_key k;
	struct dp_ct_val *v;
	struct dp_tap *tap = nat66_flow(&rk, &k, &v);
	if (!tap && !echo)
		tap = portmap6_flow(&rk, &k);
	if (!tap)
		return TC_ACT_OK;
	if (tap->flags & DP_T_PAUSED)
		return paused_drop6(tap->ifindex, tap->gen, k.sandbox_ip,
				    (const struct dp_in6 *)rk.remote_ip,
				    wake_what(k.guest_port, rk.remote_port, rk.proto, DP_WAKE_REPLY));
	__u32 tap_ifindex = tap->ifindex;
	__u32 guest[4];
	v6_guest_addr(guest, k.gaddr, c);
	if (icmp6_err_rewrite(skb, &h, 1, rk.nat_port, k.guest_port, guest) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return to_guest6(skb, tap_ifindex);
}
