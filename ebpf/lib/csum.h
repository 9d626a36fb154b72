// SPDX-License-Identifier: GPL-2.0
/* Checksum arithmetic: one's complement sums and folds, RFC 1624
 * incremental updates (16, 32 and 128 bits), the IPv6 pseudo-header, and
 * whether a frame's L4 checksum is partial (a VMM's TAP offload).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The 16-bit one's complement sum of `n` bytes (n even) at `p`, unfolded. */
static __always_inline __u32 csum_words(const void *p, int n)
{
	const __u16 *w = p;
	__u32 s = 0;
	for (int i = 0; i < n / 2; i++)
		s += w[i];
	return s;
}

static __always_inline __u16 csum_fold32(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* Whether the frame's L4 checksum at `csum_off` is partial (a VMM's TAP
 * offload: the receiving side sums the header); <0: unreadable. Asked of
 * the kernel: a checksum update of a word outside the pseudo-header
 * changes the field only when the checksum is complete. */
static __always_inline int l4_partial(struct __sk_buff *skb, __u32 csum_off)
{
	__u16 before, after;
	if (bpf_skb_load_bytes(skb, csum_off, &before, 2) ||
	    bpf_l4_csum_replace(skb, csum_off, 0, bpf_htons(1), 2) ||
	    bpf_skb_load_bytes(skb, csum_off, &after, 2))
		return -1;
	return before == after;
}

/* The ICMPv6/TCP/UDP pseudo-header's sum. */
static __always_inline __u32 v6_pseudo(const struct ip6h *ip, __u32 len, __u8 proto)
{
	return csum_words(ip->saddr, 32) + bpf_htons(len) + bpf_htons(proto);
}

/* RFC 1624: a checksum after a 16-bit word of what it covers changes
 * from `from` to `to` (both as they sit in the packet). */
static __always_inline __u16 csum_upd16(__u16 check, __u16 from, __u16 to)
{
	return ~csum_fold32((__u16)~check + (__u16)~from + to);
}

/* ... after a 32-bit word (an address) changes. */
static __always_inline __u16 csum_upd32(__u16 check, __u32 from, __u32 to)
{
	return ~csum_fold32((__u16)~check + (__u16)~(from >> 16) + (__u16)~(from & 0xffff) +
			    (to >> 16) + (to & 0xffff));
}

/* RFC 1624 for a 128-bit word (an IPv6 address) of what a checksum covers. */
static __always_inline __u16 csum_upd128(__u16 check, const __u32 *from, const __u32 *to)
{
	__u32 sum = (__u16)~check;
	for (int i = 0; i < 4; i++)
		sum += (__u16)~(from[i] >> 16) + (__u16)~(from[i] & 0xffff) + (to[i] >> 16) +
		       (to[i] & 0xffff);
	return ~csum_fold32(sum);
}
