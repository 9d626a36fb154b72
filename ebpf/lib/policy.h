// SPDX-License-Identifier: GPL-2.0
/* Egress policy and learned addresses: allow and deny CIDRs
 * (policy_allow, policy_deny, policy6_*), addresses the resolver learned
 * for allowed names (dns_learned, dns_learned6), the IPv6 world's default
 * denies, and DNS over TLS that bypasses the resolver.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Whether the resolver learned `dst` for this owner of the sandbox: for
 * a new flow (`fresh`) until the entry expires, for a flow that started
 * while the entry exists. */
static __always_inline int learned(const struct dp_sandbox *sb, __u32 dst, int fresh)
{
	struct dp_learned_key lk = {.sandbox_ip = sb->sandbox_ip, .dst = dst};
	struct dp_learned_val *lv = bpf_map_lookup_elem(&dns_learned, &lk);
	if (!lv || lv->gen != sb->gen)
		return 0;
	return !fresh || lv->expires_ns > bpf_ktime_get_ns();
}

/* Whether the sandbox's policy lets it send to `dst`: an allowed CIDR;
 * else a deny CIDR other than the catch-all 0.0.0.0/0 drops it (a DNS
 * answer never opens what a deny closes); else an address learned for an
 * allowed name; else no deny. `fresh`: no flow yet. */
static __always_inline int policy_allows(const struct dp_sandbox *sb, __u32 dst, int fresh)
{
	if (!(sb->flags & DP_F_INTERNET))
		return 0;
	struct dp_policy_key pk = {.prefixlen = 64, .sandbox_ip = sb->sandbox_ip, .dst = dst};
	if (bpf_map_lookup_elem(&policy_allow, &pk))
		return 1;
	__u8 *deny = bpf_map_lookup_elem(&policy_deny, &pk);
	if (deny && *deny != DP_DENY_CATCH_ALL)
		return 0;
	if ((sb->flags & DP_F_DOMAINS) && learned(sb, dst, fresh))
		return 1;
	return !deny;
}

/* DNS over TLS (853) to anyone but the gateway: a sandbox with domain
 * rules resolves through the agent only (its DNS to port 53 anywhere goes
 * to the agent's resolver: steer_to_agent). */
static __always_inline int resolver_bypass(const struct dp_sandbox *sb, const struct l4info *l4)
{
	if (!(sb->flags & DP_F_DOMAINS) || l4->proto == IPPROTO_ICMP)
		return 0;
	return l4->dport == bpf_htons(53) || l4->dport == bpf_htons(853);
}

/* Whether `d` is a destination the world may be sent to over IPv6 by
 * default: global unicast (2000::/3) but for the blocks that embed an
 * IPv4 address, which would slip past the IPv4 rules, or are IETF
 * protocol assignments (2001::/23, Teredo 2001::/32 among them; 2002::/16
 * 6to4). Everything else never is: ULAs fc00::/7 (the v6 metadata address
 * fd00:ec2::254 among them), link-local, multicast, loopback, ::,
 * v4-mapped ::ffff:0:0/96 and NAT64 64:ff9b::/96. */
static __always_inline int v6_world(const __u32 *d)
{
	__u32 a0 = bpf_ntohl(d[0]);
	if ((a0 >> 29) != 1)
		return 0;
	if ((a0 >> 16) == 0x2002 || (a0 & 0xfffffe00) == 0x20010000)
		return 0;
	return 1;
}

/* Whether a sandbox with IPv6 rules (DP_F_V6_RULES) may send to `d`, as
 * policy_allows for IPv4: only unicast a NAT can reach (global 2000::/3
 * and unique-local fc00::/7, less the sandboxes' own link, the metadata
 * address and the prefixes that embed IPv4 addresses: 6to4 and
 * 2001::/23, which the IPv4 rules judge); then an allow CIDR; a unique-local address only under
 * one (as the v6 world of a sandbox without rules has none); then a deny
 * CIDR other than the catch-all drops; then an address the resolver
 * learned for the sandbox (AAAA, dns_learned6; `fresh`: no flow yet);
 * then the catch-all. A global function: its own frame (guest6_out's is
 * full), verified once. */
__noinline int policy6_allows(const struct dp_sandbox *sb, const struct dp_in6 *d, int fresh)
{
	if (!sb || !d)
		return 0;
	__u32 a0 = bpf_ntohl(d->w[0]);
	int ula = (a0 >> 25) == (0xfc000000u >> 25);
	if ((a0 >> 29) != 1 && !ula)
		return 0;
	if ((a0 >> 16) == 0x2002 || (a0 & 0xfffffe00) == 0x20010000)
		return 0;
	if (a0 == DP_V6_PREFIX0 && bpf_ntohl(d->w[1]) == DP_V6_PREFIX1)
		return 0;
	/* The cloud metadata address fd00:ec2::254: never, not even under an
	 * allow CIDR (::/0 is a likely way to write "all IPv6"). */
	if (a0 == 0xfd000ec2 && !d->w[1] && !d->w[2] && d->w[3] == bpf_htonl(0x254))
		return 0;
	struct dp_policy6_key pk = {.prefixlen = 160, .sandbox_ip = sb->sandbox_ip};
	__builtin_memcpy(pk.dst, d->w, 16);
	if (bpf_map_lookup_elem(&policy6_allow, &pk))
		return 1;
	if (ula)
		return 0;
	__u8 *deny = bpf_map_lookup_elem(&policy6_deny, &pk);
	if (deny && *deny != DP_DENY_CATCH_ALL)
		return 0;
	if (sb->flags & DP_F_DOMAINS) {
		struct dp_learned6_key lk = {.sandbox_ip = sb->sandbox_ip};
		__builtin_memcpy(lk.dst, d->w, 16);
		struct dp_learned_val *lv = bpf_map_lookup_elem(&dns_learned6, &lk);
		if (lv && lv->gen == sb->gen && (!fresh || lv->expires_ns > bpf_ktime_get_ns()))
			return 1;
	}
	return !deny;
}
