// SPDX-License-Identifier: GPL-2.0
/* uplink6_frag (tail call of uplink6_in): IPv6 fragments from the world.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* A fragment from the world to the uplink's IPv6 address (uplink6_in's
 * tail call; no other extension header before it). The first one (offset
 * 0), which holds the UDP or TCP header, goes where uplink6_in would send
 * the whole datagram (a NAT66 flow's reply, a port mapping), translated
 * the same way (the L4 checksum covers the whole datagram: the
 * incremental update holds), and is noted in frags6; the later ones
 * follow it to the same guest address with only their destination
 * rewritten (IPv6 has no header checksum; they carry no ports). Anything
 * else, and a fragment whose first sibling has not come or whose sandbox
 * has a new owner, is the node's (its reassembly times out). */
SEC("classifier")
int uplink6_frag(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_OK;
	struct ip6h ip;
	struct {
		__u8 nexthdr, reserved;
		__u16 frag_off; /* the offset in 8-byte units << 3, M in bit 0 */
		__u32 id;
	} fh;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(ip), &fh, sizeof(fh)))
		return TC_ACT_OK;
	struct dp_frag6_key fk = {.id = fh.id};
	__builtin_memcpy(fk.saddr, ip.saddr, 16);
	if (bpf_ntohs(fh.frag_off) & 0xfff8) {
		struct dp_frag6_val *fv = bpf_map_lookup_elem(&frags6, &fk);
		if (!fv || bpf_ktime_get_ns() - fv->first_seen_ns > FRAG_TTL_NS)
			return TC_ACT_OK;
		__u32 ifindex = fv->ifindex;
		__u64 gen = fv->gen;
		__u8 gaddr = fv->gaddr;
		struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
		if (!sb || sb->gen != gen)
			return TC_ACT_OK;
		__u32 guest[4];
		v6_guest_addr(guest, gaddr, c);
		if (bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), guest,
					16, 0) ||
		    set_macs(skb, c->guest_mac, c->gateway_mac))
			return TC_ACT_SHOT;
		count(DP_C_FRAG);
		return to_guest6(skb, ifindex);
	}
	if (fh.nexthdr != IPPROTO_TCP && fh.nexthdr != IPPROTO_UDP)
		return TC_ACT_OK;
	struct l4info l4 = {.proto = fh.nexthdr, .off = ETH_HLEN + sizeof(ip) + sizeof(fh)};
	__u32 plen = bpf_ntohs(ip.plen);
	if (plen < sizeof(fh) || parse_ports(skb, &l4, plen - sizeof(fh)))
		return TC_ACT_OK;
	/* An atomic fragment (M = 0) is a whole datagram: nothing follows. */
	return uplink6_deliver(skb, c, &ip, &l4, (bpf_ntohs(fh.frag_off) & 1) ? &fk : NULL);
}
