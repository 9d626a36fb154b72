// SPDX-License-Identifier: GPL-2.0
/* IPv6 basics: the ICMPv6 and Neighbour Discovery numbers, the IPv6
 * header, and the guests' link addresses (fd63:7562:6500::/64 and
 * link-local: the guest's and the gateway's, fixed or EUI-64).
 * Part of datapath.bpf.c's one translation unit (see there). */

#define IPPROTO_ICMPV6 58
#define ICMP6_DST_UNREACH 1
#define ICMP6_PARAM_PROB 4
#define ICMP6_ECHO_REQUEST 128
#define ICMP6_ECHO_REPLY 129
#define ND_ROUTER_SOLICIT 133
#define ND_ROUTER_ADVERT 134
#define ND_NEIGHBOR_SOLICIT 135
#define ND_NEIGHBOR_ADVERT 136
#define ND_REDIRECT 137
#ifndef IPPROTO_FRAGMENT
#define IPPROTO_FRAGMENT 44
#endif

struct ip6h {
	__be32 vtcflow;
	__be16 plen;
	__u8 nexthdr;
	__u8 hlim;
	__u32 saddr[4];
	__u32 daddr[4];
};

/* fe80::/64 or the guests' prefix, with the modified EUI-64 of `mac`. */
static __always_inline void v6_eui64(__u32 *a, __u32 hi0, __u32 hi1, const __u8 *mac)
{
	a[0] = bpf_htonl(hi0);
	a[1] = bpf_htonl(hi1);
	a[2] = bpf_htonl(((__u32)(mac[0] ^ 2) << 24) | ((__u32)mac[1] << 16) |
			 ((__u32)mac[2] << 8) | 0xff);
	a[3] = bpf_htonl(0xfe000000 | ((__u32)mac[3] << 16) | ((__u32)mac[4] << 8) | mac[5]);
}

static __always_inline void v6_fixed(__u32 *a, __u32 lo)
{
	a[0] = bpf_htonl(DP_V6_PREFIX0);
	a[1] = bpf_htonl(DP_V6_PREFIX1);
	a[2] = 0;
	a[3] = bpf_htonl(lo);
}

static __always_inline int v6_eui64_eq(const __u32 *a, __u32 hi0, __u32 hi1, const __u8 *mac)
{
	return a[0] == bpf_htonl(hi0) && a[1] == bpf_htonl(hi1) &&
	       a[2] == bpf_htonl(((__u32)(mac[0] ^ 2) << 24) | ((__u32)mac[1] << 16) |
				 ((__u32)mac[2] << 8) | 0xff) &&
	       a[3] == bpf_htonl(0xfe000000 | ((__u32)mac[3] << 16) | ((__u32)mac[4] << 8) | mac[5]);
}

static __always_inline int v6_fixed_eq(const __u32 *a, __u32 lo)
{
	return a[0] == bpf_htonl(DP_V6_PREFIX0) && a[1] == bpf_htonl(DP_V6_PREFIX1) && !a[2] &&
	       a[3] == bpf_htonl(lo);
}

static __always_inline int v6_is_guest(const __u32 *a, const __u8 *guest_mac)
{
	return v6_fixed_eq(a, DP_V6_GUEST_LO) ||
	       v6_eui64_eq(a, DP_V6_PREFIX0, DP_V6_PREFIX1, guest_mac) ||
	       v6_eui64_eq(a, 0xfe800000, 0, guest_mac);
}

static __always_inline int v6_is_gateway(const __u32 *a, const __u8 *gateway_mac)
{
	return v6_fixed_eq(a, DP_V6_GATEWAY_LO) || v6_eui64_eq(a, 0xfe800000, 0, gateway_mac);
}

static __always_inline int v6_eq(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}
