// SPDX-License-Identifier: GPL-2.0
/* Steering to the agent: a sandbox's DNS to the agent's resolver, strict
 * mode's TCP to 80/443 to the proxy (steer_to_agent, guest_to_proxy,
 * guest_to_proxy6).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The agent's proxy port for a strict-mode sandbox's TCP flow to 80/443,
 * or 0 when the flow does not go to the proxy. */
static __always_inline __u16 proxy_port(const struct dp_sandbox *sb, const struct l4info *l4)
{
	if (!(sb->flags & (DP_F_SNI | DP_F_RULES)) || l4->proto != IPPROTO_TCP)
		return 0;
	if (l4->dport == bpf_htons(443))
		return bpf_htons(DP_PROXY_TLS_PORT);
	if (l4->dport == bpf_htons(80))
		return bpf_htons(DP_PROXY_HTTP_PORT);
	return 0;
}

/* The guest's flow to remote:port goes to an agent socket instead: strict
 * mode's TCP to 80/443 (the proxy), and DNS to anyone but the gateway of
 * a sandbox with domain rules (UDP/TCP 53: the resolver). Delivered as
 * sandbox IP -> gateway-device IP:`pport`, with the guest's source port
 * (the agent's side is the hflow key; to_sandbox_ip sends the replies
 * from remote:port). A TCP tuple whose agent-side key another live flow
 * holds (the same source port to another address) is dropped; for UDP
 * the newer flow takes the key. */
/* guest_to_proxy's answer for a TCP segment of no flow: its caller
 * (from_guest's level: the stack of a third call would not fit) sends the
 * RST with stale_reset. Not a TC_ACT_* value. */
#define PROXY_STALE 0x7ffe

/* The host flow of the guest's flow to the agent socket on port `pport`
 * (address family `family`), continued or made: kind DP_HF_PROXY, keyed
 * by the agent's side (the gateway device's address and `pport`, the
 * sandbox's address and the guest's port), the peer the guest dialled in
 * `peer_ip` or, for IPv6, `peer6`; `flags` DP_HFF_*. 0, PROXY_STALE, or
 * TC_ACT_SHOT. */
static __always_inline int proxy_flow(struct __sk_buff *skb, const struct dp_config *c,
				      const struct dp_sandbox *sb, const struct l4info *l4,
				      __u16 pport, __u8 family, __u32 peer_ip, const __u32 *peer6,
				      __u16 flags)
{
	struct dp_hflow_key key = {
		.saddr = c->host_ip,
		.daddr = sb->sandbox_ip,
		.sport = pport,
		.dport = l4->sport,
		.proto = l4->proto,
		.family = family,
	};
	const struct dp_hflow_key *hk = &key;
	struct dp_hflow_val *hv = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
	int syn = (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	if (hv && (hv->kind != DP_HF_PROXY || hv->peer_ip != peer_ip ||
		   hv->gw_port != l4->dport || hv->flags != flags ||
		   (peer6 && (hv->peer6[0] != peer6[0] || hv->peer6[1] != peer6[1] ||
			      hv->peer6[2] != peer6[2] || hv->peer6[3] != peer6[3])))) {
		if (l4->proto == IPPROTO_TCP && !(syn && tcp_closed(hv->state))) {
			count(DP_C_NO_GW_PORT);
			sb_count_fam(skb->ifindex, DP_S_NO_PORT, hk->family);
			return TC_ACT_SHOT;
		}
		hflow_drop(c, hk, hv);
		hv = NULL;
	}
	if (hv) {
		hv->last_seen_ns = bpf_ktime_get_ns();
		hv->state = tcp_state(hv->state, l4, DIR_OUT);
		return 0;
	}
	/* Only a SYN opens a TCP flow: a segment of one whose entry is gone
	 * (a guest restored from a snapshot, an expired flow) reaches no
	 * connection of the agent's; the guest gets the RST (docs/datapath.md
	 * "TCP segments of connections the sandbox never opened"). */
	if (l4->proto == IPPROTO_TCP && !syn)
		return PROXY_STALE;
	if (guest_flow_new(skb, sb, hk, l4, DP_HF_PROXY, flags, peer_ip, peer6))
		return TC_ACT_SHOT;
	return 0;
}

static __always_inline int guest_to_proxy(struct __sk_buff *skb, const struct dp_config *c,
					  const struct dp_sandbox *sb, const struct iphdr *ip,
					  const struct l4info *l4, __u16 pport)
{
	int r = proxy_flow(skb, c, sb, l4, pport, DP_HFAM_IPV4, ip->daddr, NULL, 0);
	if (r)
		return r;
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, sb->sandbox_ip, l4) ||
	    set_addr(skb, IP_DST_OFF, ip->daddr, c->host_ip, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, pport, l4))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}

#define STEER_PASS 0x7fff
/* Refused by the policy (the caller notes it: this frame is deep). */
#define STEER_REFUSED 0x7ffd

/* The part of guest -> world for a sandbox with domain rules or strict
 * mode: DNS (UDP/TCP 53) to anyone goes to the agent's resolver; with
 * DP_F_SNI, TCP to 80/443 that no allowed CIDR covers goes to the proxy
 * and UDP to 443 is dropped; STEER_PASS for anything else (on to the
 * policy and SNAT). A global function: the verifier checks it once, not
 * on every path of from_guest that reaches it. */
__noinline int steer_to_agent(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct iphdr ip;
	struct l4info l4;
	if (!sb || parse_ipv4(skb, &ip, &l4))
		return TC_ACT_SHOT;
	if ((sb->flags & DP_F_DOMAINS) && l4.dport == bpf_htons(53) &&
	    (l4.proto == IPPROTO_UDP || l4.proto == IPPROTO_TCP))
		return guest_to_proxy(skb, c, sb, &ip, &l4, bpf_htons(53));
	/* No internet access: nothing for the proxy to dial (the policy drops). */
	__u32 f = sb->flags;
	if (!(f & DP_F_INTERNET) || !(f & (DP_F_SNI | DP_F_RULES)))
		return STEER_PASS;
	__u16 pport = proxy_port(sb, &l4);
	/* Egress rules: every flow to 80/443 whose SYN the policy lets out
	 * (so the proxy may splice it to the address the guest dialled); a
	 * SYN the policy refuses goes on to the policy's drop. A later
	 * segment of no proxy flow gets the proxy path's stale reset. */
	if (pport && (f & DP_F_RULES)) {
		if ((l4.tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN || (f & DP_F_SNI) ||
		    policy_allows(sb, ip.daddr, 1))
			return guest_to_proxy(skb, c, sb, &ip, &l4, pport);
		return STEER_PASS;
	}
	if (!(f & DP_F_SNI))
		return STEER_PASS;
	struct dp_policy_key pk = {.prefixlen = 64, .sandbox_ip = sb->sandbox_ip, .dst = ip.daddr};
	if (bpf_map_lookup_elem(&policy_allow, &pk))
		return STEER_PASS;
	if (pport)
		return guest_to_proxy(skb, c, sb, &ip, &l4, pport);
	if (l4.proto == IPPROTO_UDP && l4.dport == bpf_htons(443)) {
		count(DP_C_POLICY_DROP);
		sb_count(ifindex, DP_S_POLICY);
		return STEER_REFUSED; /* QUIC: clients fall back to TCP */
	}
	return STEER_PASS;
}

/* guest_to_proxy's IPv6 twin: delivered as sandbox_ipv6 -> the gateway
 * device's IPv6 address:`pport`; the replies (host_to_sandbox6) come
 * from the address the guest dialled, to the guest address it sent from. */
static __always_inline int guest_to_proxy6(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb, const struct ip6h *ip,
					   const struct l4info *l4, __u16 pport)
{
	__u16 fixed = v6_fixed_eq(ip->saddr, DP_V6_GUEST_LO) ? DP_HFF_GUEST_FIXED : 0;
	int r = proxy_flow(skb, c, sb, l4, pport, DP_HFAM_IPV6, 0, ip->daddr, fixed);
	if (r)
		return r;
	__u32 from[4], to[4];
	pool6_addr(from, c, sb->sandbox_ip);
	pool6_addr(to, c, c->host_ip);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip->saddr, from, l4) ||
	    set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip->daddr, to, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, pport, l4))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}
