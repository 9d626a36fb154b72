// SPDX-License-Identifier: GPL-2.0
/* "The host wins": whether a socket of the node would receive a packet
 * with a given tuple (host_socket, host_socket6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Whether a socket of the host would receive a packet with this tuple
 * (saddr:sport -> daddr:dport, as it arrives): TCP established, request
 * and TIME-WAIT sockets, and listeners when `listeners` is set; any bound
 * UDP socket (connected or not). ICMP has no sockets here. */
static __always_inline int host_socket(struct __sk_buff *skb, __u8 proto, __u32 saddr,
				       __u16 sport, __u32 daddr, __u16 dport, int listeners)
{
	struct bpf_sock_tuple t = {};
	t.ipv4.saddr = saddr;
	t.ipv4.daddr = daddr;
	t.ipv4.sport = sport;
	t.ipv4.dport = dport;
	/* Two separate paths: the verifier refuses one load instruction for
	 * both a sock_common (skc lookup) and a sock pointer. */
	if (proto == IPPROTO_TCP) {
		struct bpf_sock *sk =
			bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		int owned = listeners || sk->state != BPF_TCP_LISTEN;
		bpf_sk_release(sk);
		return owned;
	}
	if (proto == IPPROTO_UDP) {
		struct bpf_sock *sk =
			bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	return 0;
}

/* The IPv6 twin of host_socket (saddr:sport -> daddr:dport as it arrives). */
static __always_inline int host_socket6(struct __sk_buff *skb, __u8 proto, const __u32 *saddr,
					__u16 sport, const __u32 *daddr, __u16 dport)
{
	struct bpf_sock_tuple t = {};
	__builtin_memcpy(t.ipv6.saddr, saddr, 16);
	__builtin_memcpy(t.ipv6.daddr, daddr, 16);
	t.ipv6.sport = sport;
	t.ipv6.dport = dport;
	if (proto == IPPROTO_TCP) {
		struct bpf_sock *sk =
			bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	if (proto == IPPROTO_UDP) {
		struct bpf_sock *sk =
			bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	return 0;
}
