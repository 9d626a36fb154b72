// SPDX-License-Identifier: GPL-2.0
/* ICMP error translation: an error from the world about a packet of a
 * sandbox flow goes to the guest as if its own packet had met it, and a
 * guest's error about a flow it holds goes out translated; IPv4
 * (icmp_error_in, icmp_error_out) and IPv6 (icmp6_error_out and the
 * rewrite the icmp6_error program uses).
 * Part of datapath.bpf.c's one translation unit (see there). */

#define ICMP_DEST_UNREACH 3
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12

/* An ICMP error from the world about a packet of a sandbox flow (a SNAT
 * flow the sandbox opened, or the sandbox's side of a port-mapped one):
 * the quoted packet left as (uplink address, NAT port); the error goes to
 * the guest as if the guest's own packet had met it: the outer
 * destination, the quoted source address and port, and the checksums
 * (outer IP, ICMP, quoted IP, quoted UDP or ICMP echo, quoted TCP when
 * the quote holds it) rewritten. Above all "fragmentation needed" (path
 * MTU discovery: dropped, a guest's large DF packets vanish on any
 * narrower link); also unreachable, time exceeded (traceroute), parameter
 * problem. Errors about nothing a live sandbox holds go to the host. */
struct icmp_err_hdrs {
	struct iphdr ip;    /* outer, no options */
	struct icmphdr icmp;
	struct iphdr in;    /* the quoted header, no options */
	__u16 l4[4];        /* its first 8 bytes after it */
};

/* Moves an ICMP error's quoted packet from address `from` and port
 * `from_port` (quoted L4 word `pw`: 0 = TCP/UDP source, 1 = destination,
 * 2 = echo id) to `to` and `to_port`, on its source side (`quoted_src`:
 * the outer destination moves too) or its destination side (the outer
 * source), with every checksum it touches: outer IP, ICMP, the quoted IP
 * header, the quoted UDP or echo checksum, and the quoted TCP checksum
 * when the quote holds it (RFC 1624 updates; the rest of the quote is
 * left as it is). Stores the headers; <0: the packet could not be read or
 * written. */
static __always_inline int icmp_err_rewrite(struct __sk_buff *skb, struct icmp_err_hdrs *h,
					    int pw, __u16 from_port, __u16 to_port, __u32 from,
					    __u32 to, int quoted_src)
{
	__u8 proto = h->in.protocol;
	__u16 ic = h->icmp.checksum;
	__u16 tcp_check = 0, tcp_new = 0;
	__u32 tcp_off = ETH_HLEN + sizeof(*h) - sizeof(h->l4) + __builtin_offsetof(struct tcphdr, check);
	int tcp_quoted = proto == IPPROTO_TCP && skb->len >= tcp_off + 2;
	if (tcp_quoted) {
		if (bpf_skb_load_bytes(skb, tcp_off, &tcp_check, 2))
			return -1;
		tcp_new = csum_upd32(csum_upd16(tcp_check, from_port, to_port), from, to);
		ic = csum_upd16(ic, tcp_check, tcp_new);
	}
	if (pw == 2) {
		__u16 old = h->l4[1];
		h->l4[1] = csum_upd16(old, from_port, to_port);
		ic = csum_upd16(ic, old, h->l4[1]);
		h->l4[2] = to_port;
	} else if (pw) {
		h->l4[1] = to_port;
	} else {
		h->l4[0] = to_port;
	}
	ic = csum_upd16(ic, from_port, to_port);
	if (proto == IPPROTO_UDP && h->l4[3]) {
		__u16 old = h->l4[3];
		__u16 n = csum_upd32(csum_upd16(old, from_port, to_port), from, to);
		h->l4[3] = n ? n : 0xffff;
		ic = csum_upd16(ic, old, h->l4[3]);
	}
	__u16 in_check = h->in.check;
	h->in.check = csum_upd32(in_check, from, to);
	if (quoted_src) {
		h->in.saddr = to;
		h->ip.check = csum_upd32(h->ip.check, h->ip.daddr, to);
		h->ip.daddr = to;
	} else {
		h->in.daddr = to;
		h->ip.check = csum_upd32(h->ip.check, h->ip.saddr, to);
		h->ip.saddr = to;
	}
	h->icmp.checksum = csum_upd16(csum_upd32(ic, from, to), in_check, h->in.check);
	if (bpf_skb_store_bytes(skb, ETH_HLEN, h, sizeof(*h), 0) ||
	    (tcp_quoted && bpf_skb_store_bytes(skb, tcp_off, &tcp_new, 2, 0)))
		return -1;
	return 0;
}

__noinline int icmp_error_in(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_OK;
	struct icmp_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || h.ip.ihl != 5 ||
	    h.in.version != 4 || h.in.ihl != 5 || h.in.saddr != c->uplink_ip ||
	    (h.in.frag_off & bpf_htons(IP_OFFSET)))
		return TC_ACT_OK;
	__u8 proto = h.in.protocol;
	__u16 nat_port, remote_port;
	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP) {
		nat_port = h.l4[0];
		remote_port = h.l4[1];
	} else if (proto == IPPROTO_ICMP && ((__u8 *)h.l4)[0] == ICMP_ECHO) {
		nat_port = h.l4[2]; /* the echo id */
		remote_port = 0;
	} else {
		return TC_ACT_OK;
	}
	struct dp_ct_key key = {
		.remote_ip = h.in.daddr,
		.remote_port = remote_port,
		.proto = proto,
	};
	__u8 kind;
	__u64 gen;
	struct dp_rev_key rk = {
		.remote_ip = h.in.daddr,
		.remote_port = remote_port,
		.nat_port = nat_port,
		.proto = proto,
	};
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
	if (rv) {
		if (!rv->sandbox_ip)
			return TC_ACT_OK; /* a host connection to_uplink moved */
		key.sandbox_ip = rv->sandbox_ip;
		key.guest_port = rv->guest_port;
		gen = rv->gen;
		kind = DP_CT_SNAT;
	} else {
		if (proto == IPPROTO_ICMP)
			return TC_ACT_OK;
		struct dp_portmap_val *pm = find_portmap(c->uplink_ip, nat_port, proto, 1);
		if (!pm)
			return TC_ACT_OK;
		key.sandbox_ip = pm->sandbox_ip;
		key.guest_port = pm->container_port;
		struct dp_tap *t = bpf_map_lookup_elem(&by_ip, &key.sandbox_ip);
		if (!t)
			return TC_ACT_OK;
		gen = t->gen;
		kind = DP_CT_PORTMAP;
	}
	/* Only a live flow of the address's current owner: an error never
	 * reaches a sandbox about packets it did not send. */
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
	if (!v || v->gen != gen || v->nat_port != nat_port || v->kind != kind)
		return TC_ACT_OK;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &key.sandbox_ip);
	if (!tap || tap->gen != gen)
		return TC_ACT_OK;
	if (tap->flags & DP_T_PAUSED)
		return TC_ACT_SHOT;
	__u32 tap_ifindex = tap->ifindex;

	if (icmp_err_rewrite(skb, &h, proto == IPPROTO_ICMP ? 2 : 0, nat_port, key.guest_port,
			     c->uplink_ip, c->guest_ip, 1) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return bpf_redirect(tap_ifindex, 0);
}

/* The other way: an ICMP error a guest sends about a packet of a flow it
 * holds (a port-mapped flow the world opened, or a reply to one it
 * opened: "port unreachable" above all) leaves as the node's: the outer
 * source, the quoted destination address and port (what the world sent
 * to: the uplink address and the flow's NAT or host port) and the
 * checksums are rewritten. Not subject to the egress policy (the flow was
 * admitted, and the error goes to the flow's remote only); anything about
 * no live flow of this sandbox is dropped. */
__noinline int icmp_error_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct icmp_err_hdrs h;
	if (!sb || !c->uplink_ip || bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) ||
	    h.ip.ihl != 5 || h.in.version != 4 || h.in.ihl != 5 || h.in.daddr != c->guest_ip ||
	    h.in.saddr != h.ip.daddr || (h.in.frag_off & bpf_htons(IP_OFFSET)) ||
	    (h.in.protocol != IPPROTO_TCP && h.in.protocol != IPPROTO_UDP))
		goto drop;
	struct dp_ct_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.remote_ip = h.in.saddr,
		.guest_port = h.l4[1],
		.remote_port = h.l4[0],
		.proto = h.in.protocol,
	};
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
	if (!v || v->gen != sb->gen)
		goto drop;
	if (icmp_err_rewrite(skb, &h, 1, key.guest_port, v->nat_port, c->guest_ip, c->uplink_ip, 0))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return forward_out(skb, c, h.ip.daddr, h.ip.tos, IPPROTO_ICMP);
drop:
	sb_count(ifindex, DP_S_UNSUPPORTED);
	return TC_ACT_SHOT;
}

/* An ICMPv6 error and the packet it quotes (no extension headers). */
struct icmp6_err_hdrs {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__u32 info;          /* Packet Too Big: the MTU */
	struct ip6h in;      /* the quoted header */
	__u16 l4[4];         /* its first 8 bytes after it */
};

/* Rewrites an ICMPv6 error and the packet it quotes for the other side of
 * a translated flow: the address `from` (with `in`: the outer destination
 * and the quoted source, the uplink's; else the outer source and the
 * quoted destination, the guest's) becomes `to`, the quoted port
 * `from_port` becomes `to_port`, and every checksum they touch follows. */
static __always_inline int icmp6_err_rewrite(struct __sk_buff *skb, struct icmp6_err_hdrs *h,
					     int in, __u16 from_port, __u16 to_port,
					     const __u32 *to)
{
	__u8 proto = h->in.nexthdr;
	int echo = proto == IPPROTO_ICMPV6;
	__u32 from[4];
	__builtin_memcpy(from, in ? h->in.saddr : h->in.daddr, 16);
	__u16 ic = csum_upd128(h->csum, from, to); /* the outer address */
	ic = csum_upd128(ic, from, to);            /* the quoted one */
	ic = csum_upd16(ic, from_port, to_port);
	/* The quoted L4 checksum (pseudo-header: the quoted address; and the
	 * port): UDP's and echo's are in the 8 bytes, TCP's when quoted. */
	__u32 tcp_off = ETH_HLEN + sizeof(*h) - sizeof(h->l4) + __builtin_offsetof(struct tcphdr, check);
	__u16 tcp_check = 0, tcp_new = 0;
	int tcp_quoted = proto == IPPROTO_TCP && skb->len >= tcp_off + 2;
	if (tcp_quoted) {
		if (bpf_skb_load_bytes(skb, tcp_off, &tcp_check, 2))
			return -1;
		tcp_new = csum_upd128(csum_upd16(tcp_check, from_port, to_port), from, to);
		ic = csum_upd16(ic, tcp_check, tcp_new);
	}
	int cw = echo ? 1 : 3; /* the quoted checksum's word */
	if (proto != IPPROTO_TCP) {
		__u16 old = h->l4[cw];
		__u16 n = csum_upd128(csum_upd16(old, from_port, to_port), from, to);
		h->l4[cw] = n = (n || echo) ? n : 0xffff; /* UDP: 0 is "none" */
		ic = csum_upd16(ic, old, n);
	}
	if (in) {
		h->l4[echo ? 2 : 0] = to_port;
		__builtin_memcpy(h->in.saddr, to, 16);
		__builtin_memcpy(h->ip.daddr, to, 16);
	} else {
		h->l4[1] = to_port;
		__builtin_memcpy(h->in.daddr, to, 16);
		__builtin_memcpy(h->ip.saddr, to, 16);
	}
	h->csum = ic;
	if (bpf_skb_store_bytes(skb, ETH_HLEN, h, sizeof(*h), 0) ||
	    (tcp_quoted && bpf_skb_store_bytes(skb, tcp_off, &tcp_new, 2, 0)))
		return -1;
	return 0;
}

/* A guest's ICMPv6 error about a packet of a flow it holds (a port-mapped
 * flow the world opened, or the replies of one it opened: "port
 * unreachable", or Packet Too Big from a guest whose link is narrower)
 * leaves as the node's, as icmp_error_out does for IPv4: the outer source,
 * the quoted destination address and port (what the world sent to: the
 * uplink's address and the flow's NAT or host port) and the checksums are
 * rewritten. Anything about no live flow of this sandbox is dropped. */
static __always_inline int icmp6_error_out(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb)
{
	__u32 ifindex = skb->ifindex;
	struct icmp6_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || !v6_eq(h.in.saddr, h.ip.daddr) ||
	    (h.in.nexthdr != IPPROTO_TCP && h.in.nexthdr != IPPROTO_UDP))
		goto drop;
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = h.l4[1],
		.remote_port = h.l4[0],
		.proto = h.in.nexthdr,
		.gaddr = v6_fixed_eq(h.in.daddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__u32 guest[4];
	v6_guest_addr(guest, key.gaddr, c);
	if (!v6_eq(h.in.daddr, guest) || !v6_eq(h.ip.saddr, guest))
		goto drop;
	__builtin_memcpy(key.remote_ip, h.in.saddr, 16);
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	if (!v || v->gen != sb->gen ||
	    (v->kind == DP_CT_PORTMAP &&
	     !portmap6_live(sb->sandbox_ip, v->nat_port, key.proto, key.guest_port)))
		goto drop;
	if (icmp6_err_rewrite(skb, &h, 0, key.guest_port, v->nat_port, c->uplink_ip6))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return forward_out6(skb, c, h.ip.daddr, IPPROTO_ICMPV6);
drop:
	sb_count6(ifindex, DP_S_UNSUPPORTED);
	return TC_ACT_SHOT;
}
