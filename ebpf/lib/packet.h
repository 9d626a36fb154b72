// SPDX-License-Identifier: GPL-2.0
/* Parsing and rewriting packets: the IPv4 and IPv6 headers and the
 * TCP/UDP/ICMP fields NAT needs (parse_ipv4, parse_ipv6, parse_ports),
 * addresses, ports and MACs rewritten with their checksums (set_addr,
 * set_addr6, set_port, set_macs).
 * Part of datapath.bpf.c's one translation unit (see there). */

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] &&
	       a[4] == b[4] && a[5] == b[5];
}

/* Reads the IPv4 header and what NAT needs of L4. <0: malformed. */
/* The TCP or UDP header at l4->off (l4->proto says which): ports, the
 * checksum's offset, and TCP's flags and sequence numbers (`len`: the
 * bytes from the L4 header on, for the sequence after the segment). */
static __always_inline int parse_ports(struct __sk_buff *skb, struct l4info *l4, __u32 len)
{
	if (l4->proto == IPPROTO_TCP) {
		struct tcphdr th;
		if (bpf_skb_load_bytes(skb, l4->off, &th, sizeof(th)))
			return -1;
		l4->sport = th.source;
		l4->dport = th.dest;
		l4->csum_off = l4->off + __builtin_offsetof(struct tcphdr, check);
		l4->tcp_flags = (th.fin ? TCP_FIN : 0) | (th.rst ? TCP_RST : 0) |
				(th.syn ? TCP_SYN : 0) | (th.ack ? TCP_ACK : 0);
		l4->tcp_doff = th.doff;
		l4->tcp_seq = bpf_ntohl(th.seq);
		__u32 hdr = th.doff * 4;
		l4->tcp_end = l4->tcp_seq + (len > hdr ? len - hdr : 0) + th.fin + th.syn;
		return 0;
	}
	struct udphdr uh;
	if (bpf_skb_load_bytes(skb, l4->off, &uh, sizeof(uh)))
		return -1;
	l4->sport = uh.source;
	l4->dport = uh.dest;
	l4->csum_off = l4->off + __builtin_offsetof(struct udphdr, check);
	return 0;
}

static __always_inline int parse_ipv4(struct __sk_buff *skb, struct iphdr *ip,
				      struct l4info *l4)
{
	if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(*ip)))
		return -1;
	if (ip->version != 4 || ip->ihl < 5)
		return -1;
	__builtin_memset(l4, 0, sizeof(*l4));
	l4->proto = ip->protocol;
	l4->off = ETH_HLEN + ip->ihl * 4;
	if (ip->frag_off & bpf_htons(IP_OFFSET)) {
		l4->frag = 1;
		return 0;
	}
	if (ip->frag_off & bpf_htons(IP_MF))
		l4->first_frag = 1;
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		__u32 tot = bpf_ntohs(ip->tot_len), hl = ip->ihl * 4;
		return parse_ports(skb, l4, tot > hl ? tot - hl : 0);
	} else if (ip->protocol == IPPROTO_ICMP) {
		struct icmphdr ih;
		if (bpf_skb_load_bytes(skb, l4->off, &ih, sizeof(ih)))
			return -1;
		l4->icmp_type = ih.type;
		l4->sport = ih.id;
		l4->dport = ih.id;
		l4->csum_off = l4->off + __builtin_offsetof(struct icmphdr, checksum);
	}
	return 0;
}

static __always_inline __u64 l4_csum_flags(const struct l4info *l4)
{
	return l4->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* Replaces an IPv4 address (at `off`), fixing the IP checksum and the
 * TCP/UDP pseudo-header checksum. */
static __always_inline int set_addr(struct __sk_buff *skb, __u32 off, __u32 old,
				    __u32 new, const struct l4info *l4)
{
	if (old == new)
		return 0;
	if (!l4->frag && (l4->proto == IPPROTO_TCP || l4->proto == IPPROTO_UDP)) {
		if (bpf_l4_csum_replace(skb, l4->csum_off, old, new,
					BPF_F_PSEUDO_HDR | sizeof(new) | l4_csum_flags(l4)))
			return -1;
	}
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* Replaces a port (or ICMP echo id) at `off`, fixing the L4 checksum. */
static __always_inline int set_port(struct __sk_buff *skb, __u32 off, __u16 old,
				    __u16 new, const struct l4info *l4)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4->csum_off, old, new,
				sizeof(new) | l4_csum_flags(l4)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline __u32 src_port_off(const struct l4info *l4)
{
	/* TCP and UDP source ports are the first field; the ICMP echo id is at 4. */
	return l4->proto == IPPROTO_ICMP ? l4->off + 4 : l4->off;
}

static __always_inline __u32 dst_port_off(const struct l4info *l4)
{
	return l4->proto == IPPROTO_ICMP ? l4->off + 4 : l4->off + 2;
}

static __always_inline int set_macs(struct __sk_buff *skb, const __u8 *dst, const __u8 *src)
{
	__u8 macs[12];
	__builtin_memcpy(macs, dst, 6);
	__builtin_memcpy(macs + 6, src, 6);
	return bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0);
}

/* Replaces an IPv6 address (at `off`), fixing the pseudo-header part of
 * the L4 checksum (TCP, UDP and ICMPv6 all cover it). */
static __always_inline int set_addr6(struct __sk_buff *skb, __u32 off, const __u32 *old,
				     const __u32 *new, const struct l4info *l4)
{
	__s64 diff = bpf_csum_diff((__u32 *)old, 16, (__u32 *)new, 16, 0);
	if (diff < 0 ||
	    bpf_l4_csum_replace(skb, l4->csum_off, 0, diff, BPF_F_PSEUDO_HDR | l4_csum_flags(l4)))
		return -1;
	return bpf_skb_store_bytes(skb, off, (__u32 *)new, 16, 0);
}

/* Parses an IPv6 packet's TCP, UDP or ICMPv6 header right after the fixed
 * one (no extension headers: a guest's fragments are dropped, as IPv4's). */
static __always_inline int parse_ipv6(struct __sk_buff *skb, struct ip6h *ip,
				      struct l4info *l4)
{
	if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(*ip)) ||
	    (bpf_ntohl(ip->vtcflow) >> 28) != 6)
		return -1;
	__builtin_memset(l4, 0, sizeof(*l4));
	l4->proto = ip->nexthdr;
	l4->off = ETH_HLEN + sizeof(*ip);
	if (ip->nexthdr == IPPROTO_TCP || ip->nexthdr == IPPROTO_UDP) {
		return parse_ports(skb, l4, bpf_ntohs(ip->plen));
	} else if (ip->nexthdr == IPPROTO_ICMPV6) {
		__u8 ih[8];
		if (bpf_skb_load_bytes(skb, l4->off, ih, sizeof(ih)))
			return -1;
		l4->icmp_type = ih[0];
		l4->sport = *(__u16 *)&ih[4]; /* echo id */
		l4->dport = l4->sport;
		l4->csum_off = l4->off + 2;
		/* src_port_off/dst_port_off find the id at 4, as ICMP's. */
		l4->proto = IPPROTO_ICMP;
	}
	return 0;
}
