// SPDX-License-Identifier: GPL-2.0
/* The guests' IPv6 link: Router Advertisements, Neighbour Solicitations
 * and Advertisements, echo, and refusals (RST, unreachable) of what a
 * guest may not send (guest_ipv6, answer6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* ---- The guests' IPv6 link (docs/dual-stack.md) ------------------------
 * There is no IPv6 egress yet (NAT66 is a later slice), so the link is
 * what a router with no upstream offers: Router Solicitations get a Router
 * Advertisement with the on-link prefix for SLAAC and a router lifetime of
 * 0 (no default route: connections off the link fail at once in the
 * guest), the gateway's addresses answer Neighbour Solicitations and
 * echo, and whatever a guest still sends off its link (a static default
 * route) gets an RST or an ICMPv6 unreachable back at once, never a
 * timeout. Guests' RAs, redirects and DHCPv6 server messages are dropped
 * and counted; MLD and DAD are dropped quietly. */

/* Replaces the frame with an IPv6 packet of `total` bytes, the first
 * `len` from `p` (the rest stored by the caller), and sends it back to
 * the guest. */
static __always_inline int v6_answer(struct __sk_buff *skb, const struct dp_config *c,
				     const void *p, __u32 len, __u32 total)
{
	if (bpf_skb_change_tail(skb, ETH_HLEN + total, 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, p, len, 0) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	/* The link's own answers (NA, RA, refusals) go ahead of bulk data on
	 * a limited sandbox's device (its default class is the bulk leaf). */
	skb->priority = DP_TAP_CLASS_SMALL;
	return bpf_redirect(skb->ifindex, 0);
}

/* The RA after its IPv6 header (built in guest_ipv6's copy of the
 * guest's header, whose job is done by then: the stack is full). */
struct v6_ra {
	__u8 type, code;
	__u16 csum;
	__u8 hop_limit, flags;
	__be16 lifetime;
	__be32 reachable, retrans;
	__u8 sll_type, sll_len, sll[6];
	__u8 pi_type, pi_len, pi_prefix_len, pi_flags;
	__be32 pi_valid, pi_preferred, pi_reserved;
	__u32 pi_prefix[4];
	/* Route Information (RFC 4191) for ::/0: the default route with a
	 * lifetime of its own, infinite, so a guest keeps it with no periodic
	 * RAs (a router lifetime is at most 9000 s; Linux takes the longer). */
	__u8 ri_type, ri_len, ri_prefix_len, ri_flags;
	__be32 ri_lifetime;
	/* Recursive DNS Server (RFC 8106): the agent's resolver at the
	 * gateway's fd63:7562:6500::5, where the node reaches sandboxes over
	 * IPv6 (pool6); lifetime 0 (no server) where it does not. */
	__u8 rd_type, rd_len;
	__u16 rd_reserved;
	__be32 rd_lifetime;
	__u32 rd_addr[4];
};
struct v6_na {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__be32 flags;
	__u32 target[4];
	__u8 tll_type, tll_len, tll[6];
};
struct v6_rst {
	struct ip6h ip;
	struct tcphdr th;
};
/* Destination unreachable, up to the quote (the guest's own header and 8
 * bytes: guest_ipv6's copy of them follows). */
struct v6_unreach {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__u16 unused[2];
};
_Static_assert(sizeof(struct v6_ra) == 88, "RA layout");
_Static_assert(sizeof(struct v6_na) == 72, "NA layout");
_Static_assert(sizeof(struct v6_unreach) == 48, "unreachable layout");

/* guest_ipv6's answer for a packet to the world from a sandbox that may
 * send there (from_guest tail-calls guest6_out). */
#define V6_TO_WORLD 0x7700
/* guest_ipv6's answer for TCP, UDP or an echo reply to the gateway's
 * fd63:7562:6500::5 on a node with host <-> sandbox over IPv6: its
 * caller goes on with guest_to_host6. Not a TC_ACT_* value. */
#define V6_TO_HOST 0x7701
/* guest_ipv6's answer for DNS, HTTP or HTTPS to the world from a sandbox
 * with domain rules or in strict mode: its caller tail-calls guest6_steer. */
#define V6_STEER 0x7702
/* guest_ipv6's modes: judge the packet; or refuse what is not the link's
 * (counted as refused, or not: the caller counted why). */
#define V6_JUDGE 0
#define V6_REFUSE 1
#define V6_REFUSE_QUIET 2
/* deny_action "reject" (guest6_rst): a TCP SYN gets an RST, anything else
 * ICMPv6 unreachable, administratively prohibited (code 1); quiet. */
#define V6_REJECT 3

/* Whether the guest on `ifindex` is sent IPv6 to the world (the node has
 * IPv6 egress and the sandbox may use it). */
static __always_inline int v6_router(const struct dp_config *c, __u32 ifindex)
{
	if (!(c->flags & DP_CFG_IPV6_EGRESS))
		return 0;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	return sb && (sb->flags & DP_F_V6_OUT);
}

__noinline int guest_ipv6(struct __sk_buff *skb, int mode)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	union {
		struct v6_ra ra;
		struct v6_na na;
		struct v6_rst r;
		struct v6_unreach e;
	} u;
	__u8 dmac[6];
	struct {
		struct ip6h ip;
		__u8 l4[8]; /* ICMPv6 type, code; TCP/UDP ports */
	} h;
	if (bpf_skb_load_bytes(skb, 0, dmac, sizeof(dmac)) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || (bpf_ntohl(h.ip.vtcflow) >> 28) != 6) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	/* Hop-by-hop options: MLD reports (router alert); nothing else a
	 * guest needs. Quietly. */
	if (h.ip.nexthdr == 0)
		return TC_ACT_SHOT;
	int mcast = (bpf_ntohl(h.ip.daddr[0]) >> 24) == 0xff;
	/* The link's only other node is the gateway: unicast goes to its MAC,
	 * multicast to 33:33:<low 32 bits>. */
	if (mcast ? !(dmac[0] == 0x33 && dmac[1] == 0x33) : !mac_eq(dmac, c->gateway_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count6(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	__u8 type = h.l4[0];
	int icmp = h.ip.nexthdr == IPPROTO_ICMPV6;
	/* Duplicate address detection (an NS from ::) is never answered with
	 * an NA, the guest's addresses are its own; but it means the guest's
	 * link just came up, and an RA right then spares it the wait for its
	 * link-local address and its Router Solicitation. */
	int dad = 0;
	if (!v6_is_guest(h.ip.saddr, c->guest_mac)) {
		dad = !(h.ip.saddr[0] | h.ip.saddr[1] | h.ip.saddr[2] | h.ip.saddr[3]) && icmp &&
		      type == ND_NEIGHBOR_SOLICIT;
		if (!dad) {
			count(DP_C_SPOOF_DROP);
			sb_count6(ifindex, DP_S_SPOOFED);
			return TC_ACT_SHOT;
		}
	}
	if (icmp) {
		if (type == ND_ROUTER_ADVERT || type == ND_REDIRECT) {
			count(DP_C_ROGUE_ND);
			sb_count6(ifindex, DP_S_SPOOFED);
			return TC_ACT_SHOT;
		}
		if (type >= 130 && type <= 136 && h.ip.hlim != 255)
			return TC_ACT_SHOT; /* ND and MLD come from the link only */
		if (type == ND_ROUTER_SOLICIT || dad) {
			__builtin_memset(&u.ra, 0, sizeof(u.ra));
			__u32 len = sizeof(u.ra);
			__builtin_memset(&h.ip, 0, sizeof(h.ip));
			h.ip.vtcflow = bpf_htonl(0x60000000);
			h.ip.plen = bpf_htons(len);
			h.ip.nexthdr = IPPROTO_ICMPV6;
			h.ip.hlim = 255;
			v6_eui64(h.ip.saddr, 0xfe800000, 0, c->gateway_mac);
			h.ip.daddr[0] = bpf_htonl(0xff020000); /* all nodes */
			h.ip.daddr[3] = bpf_htonl(1);
			u.ra.type = ND_ROUTER_ADVERT;
			u.ra.hop_limit = 64;
			u.ra.sll_type = 1;
			u.ra.sll_len = 1;
			__builtin_memcpy(u.ra.sll, c->gateway_mac, 6);
			u.ra.pi_type = 3;
			u.ra.pi_len = 4;
			u.ra.pi_prefix_len = 64;
			u.ra.pi_flags = 0xc0; /* on-link, autonomous */
			u.ra.pi_valid = 0xffffffff;
			u.ra.pi_preferred = 0xffffffff;
			v6_fixed(u.ra.pi_prefix, 0);
			u.ra.ri_type = 24;
			u.ra.ri_len = 1;
			u.ra.rd_type = 25;
			u.ra.rd_len = 3;
			v6_fixed(u.ra.rd_addr, DP_V6_GATEWAY_LO);
			if (c->pool6[0] | c->pool6[1] | c->pool6[2])
				u.ra.rd_lifetime = 0xffffffff;
			/* Without IPv6 egress, lifetimes 0: not a default router. */
			if (v6_router(c, ifindex)) {
				u.ra.lifetime = bpf_htons(9000);
				u.ra.ri_lifetime = 0xffffffff;
			}
			u.ra.csum = ~csum_fold32(v6_pseudo(&h.ip, len, IPPROTO_ICMPV6) +
					       csum_words(&u.ra, len));
			count(DP_C_ND_REPLY);
			if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(h.ip) + len, 0) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN, &h.ip, sizeof(h.ip), 0) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(h.ip), &u.ra, len, 0) ||
			    set_macs(skb, c->guest_mac, c->gateway_mac))
				return TC_ACT_SHOT;
			return bpf_redirect(ifindex, 0);
		}
		if (type == ND_NEIGHBOR_SOLICIT) {
			__u32 off = ETH_HLEN + sizeof(struct ip6h) + 8;
			if (bpf_skb_load_bytes(skb, off, u.na.target, sizeof(u.na.target)) ||
			    !v6_is_gateway(u.na.target, c->gateway_mac))
				return TC_ACT_SHOT; /* nobody else is on the link */
			__u32 len = sizeof(u.na) - sizeof(u.na.ip);
			u.na.ip.vtcflow = bpf_htonl(0x60000000);
			u.na.ip.plen = bpf_htons(len);
			u.na.ip.nexthdr = IPPROTO_ICMPV6;
			u.na.ip.hlim = 255;
			__builtin_memcpy(u.na.ip.saddr, u.na.target, 16);
			__builtin_memcpy(u.na.ip.daddr, h.ip.saddr, 16);
			u.na.type = ND_NEIGHBOR_ADVERT;
			u.na.code = 0;
			u.na.csum = 0;
			u.na.flags = bpf_htonl(0xe0000000); /* router, solicited, override */
			u.na.tll_type = 2;
			u.na.tll_len = 1;
			__builtin_memcpy(u.na.tll, c->gateway_mac, 6);
			u.na.csum = ~csum_fold32(v6_pseudo(&u.na.ip, len, IPPROTO_ICMPV6) +
					       csum_words(&u.na.type, len));
			count(DP_C_ND_REPLY);
			return v6_answer(skb, c, &u.na, sizeof(u.na), sizeof(u.na));
		}
		if (type == ICMP6_ECHO_REQUEST && v6_is_gateway(h.ip.daddr, c->gateway_mac)) {
			/* Turned around in place: swapping the addresses keeps
			 * the pseudo-header's sum. */
			__u32 csum_off = ETH_HLEN + sizeof(struct ip6h) + 2;
			__u32 a_off = ETH_HLEN + __builtin_offsetof(struct ip6h, saddr);
			if (bpf_skb_store_bytes(skb, a_off, h.ip.daddr, 16, 0) ||
			    bpf_skb_store_bytes(skb, a_off + 16, h.ip.saddr, 16, 0) ||
			    bpf_l4_csum_replace(skb, csum_off, bpf_htons(ICMP6_ECHO_REQUEST << 8),
						bpf_htons(ICMP6_ECHO_REPLY << 8), 2) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(struct ip6h), &(__u8){ICMP6_ECHO_REPLY},
						1, 0) ||
			    set_macs(skb, c->guest_mac, c->gateway_mac))
				return TC_ACT_SHOT;
			count(DP_C_ND_REPLY);
			return bpf_redirect(ifindex, 0);
		}
		if (type >= 130 && type <= 143)
			return TC_ACT_SHOT; /* MLD, NA, ...: quietly */
	}
	if (h.ip.nexthdr == IPPROTO_UDP && (h.l4[0] << 8 | h.l4[1]) == 547) {
		count(DP_C_ROGUE_ND); /* a DHCPv6 server or relay */
		sb_count6(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	/* No error answers a multicast packet (RFC 4443 2.4). */
	if (mcast)
		return TC_ACT_SHOT;
	/* To the node through the gateway's unique-local address. */
	if (mode == V6_JUDGE && (c->pool6[0] | c->pool6[1] | c->pool6[2]) &&
	    v6_fixed_eq(h.ip.daddr, DP_V6_GATEWAY_LO) &&
	    (h.ip.nexthdr == IPPROTO_TCP || h.ip.nexthdr == IPPROTO_UDP ||
	     (icmp && type == ICMP6_ECHO_REPLY)))
		return V6_TO_HOST;

	/* The world (not the link, nor link-local): DNS of a sandbox with
	 * domain rules, HTTP and HTTPS of one in strict mode or with egress
	 * rules to guest6_steer
	 * (the agent's resolver and proxy); else, for a sandbox that may
	 * reach it, NAT66 in guest6_out. */
	__u32 d0 = bpf_ntohl(h.ip.daddr[0]);
	if (mode == V6_JUDGE && (d0 >> 22) != (0xfe800000 >> 22) &&
	    !(d0 == DP_V6_PREFIX0 && bpf_ntohl(h.ip.daddr[1]) == DP_V6_PREFIX1) &&
	    bpf_ntohl(h.ip.saddr[0]) != 0xfe800000) {
		__u16 dport = h.l4[2] << 8 | h.l4[3];
		if ((h.ip.nexthdr == IPPROTO_TCP || h.ip.nexthdr == IPPROTO_UDP) &&
		    (dport == 53 || dport == 80 || dport == 443)) {
			struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
			if (sb && (sb->flags & (dport == 53 ? DP_F_DOMAINS : (DP_F_SNI | DP_F_RULES))))
				return V6_STEER;
		}
		if (v6_router(c, ifindex))
			return V6_TO_WORLD;
	}
	/* Everything else has nowhere to go: refused at once. */
	if (mode != V6_REFUSE_QUIET && mode != V6_REJECT) {
		count(DP_C_IPV6_REFUSED);
		sb_count6(ifindex, DP_S_NO_ROUTE);
	}
	__u32 l4_off = ETH_HLEN + sizeof(struct ip6h);
	if (h.ip.nexthdr == IPPROTO_TCP) {
		struct tcphdr th;
		if (bpf_skb_load_bytes(skb, l4_off, &th, sizeof(th)) || th.rst)
			return TC_ACT_SHOT;
		int partial = l4_partial(skb, l4_off + __builtin_offsetof(struct tcphdr, check));
		if (partial < 0)
			return TC_ACT_SHOT;
		__u32 plen = bpf_ntohs(h.ip.plen);
		__builtin_memset(&u.r.ip, 0, sizeof(u.r.ip));
		u.r.ip.vtcflow = bpf_htonl(0x60000000);
		u.r.ip.plen = bpf_htons(sizeof(u.r.th));
		u.r.ip.nexthdr = IPPROTO_TCP;
		u.r.ip.hlim = 64;
		__builtin_memcpy(u.r.ip.saddr, h.ip.daddr, 16);
		__builtin_memcpy(u.r.ip.daddr, h.ip.saddr, 16);
		rst_for(&th, plen > th.doff * 4u ? plen - th.doff * 4u : 0, &u.r.th);
		__u32 pseudo = v6_pseudo(&u.r.ip, sizeof(u.r.th), IPPROTO_TCP);
		if (partial)
			u.r.th.check = csum_fold32(pseudo);
		else
			u.r.th.check = ~csum_fold32(pseudo + csum_words(&u.r.th, sizeof(u.r.th)));
		return v6_answer(skb, c, &u.r, sizeof(u.r), sizeof(u.r));
	}
	if (icmp && type < 128)
		return TC_ACT_SHOT; /* never an error about an error */
	/* Destination unreachable, no route, quoting the header and the first
	 * 8 bytes after it (enough for the guest to find the socket). A
	 * partial UDP checksum stays partial: the far side sums from the
	 * ICMPv6 header and stores at its offset 6, inside the "unused" word,
	 * which receivers ignore; seeded with the pseudo-header's sum, the
	 * message's checksum comes out right wherever it is stored. */
	int partial = 0;
	if (h.ip.nexthdr == IPPROTO_UDP) {
		partial = l4_partial(skb, l4_off + 6);
		if (partial < 0)
			return TC_ACT_SHOT;
	}
	__builtin_memset(&u.e, 0, sizeof(u.e));
	__u32 len = sizeof(u.e) - sizeof(u.e.ip) + sizeof(h);
	u.e.ip.vtcflow = bpf_htonl(0x60000000);
	u.e.ip.plen = bpf_htons(len);
	u.e.ip.nexthdr = IPPROTO_ICMPV6;
	u.e.ip.hlim = 64;
	v6_eui64(u.e.ip.saddr, 0xfe800000, 0, c->gateway_mac);
	__builtin_memcpy(u.e.ip.daddr, h.ip.saddr, 16);
	u.e.type = ICMP6_DST_UNREACH;
	u.e.code = mode == V6_REJECT ? 1 : 0;
	__u32 pseudo = v6_pseudo(&u.e.ip, len, IPPROTO_ICMPV6);
	if (partial)
		u.e.unused[1] = csum_fold32(pseudo);
	else
		u.e.csum = ~csum_fold32(pseudo + csum_words(&u.e.type, 8) + csum_words(&h, sizeof(h)));
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(u.e) + sizeof(h), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(u.e), &h, sizeof(h), 0))
		return TC_ACT_SHOT;
	return v6_answer(skb, c, &u.e, sizeof(u.e), sizeof(u.e) + sizeof(h));
}

/* guest_ipv6, its answer on the link (RA, NA, echo reply, RST,
 * unreachable: back into the guest's TAP) counted as IPv6 sent to the
 * sandbox (here: a third call's stack would not fit below guest_ipv6). */
static __always_inline int answer6(struct __sk_buff *skb, int mode)
{
	int r = guest_ipv6(skb, mode);
	if (r == TC_ACT_REDIRECT)
		traffic6(skb->ifindex, 1, skb->len);
	return r;
}
