// SPDX-License-Identifier: GPL-2.0
/* Which of its two IPv6 addresses a guest uses (the fixed
 * fd63:7562:6500::6 or its SLAAC one: sb_share.guest6, which from_guest's
 * learn_guest6 learns), the address a NAT66 flow was sent from, and the
 * ct6 entry of a mapped flow whatever the guest's address.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The guest on `ifindex` uses its static fd63:7562:6500::6 (sb_share.
 * guest6, learn_guest6), not its SLAAC address. */
static __always_inline int guest_fixed6(__u32 ifindex)
{
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	return s && s->guest6 == DP_SHARE_FIXED6;
}

/* The ct6 entry under `key` of a mapped flow to the guest on `ifindex`
 * (owner generation `gen`), whatever its guest address: the guest's
 * current one (guest_fixed6) first, else the other one if a live mapped
 * flow of this owner has it (a guest with both addresses may have changed
 * its current one since the flow started: the flow keeps its own).
 * `key->gaddr` is left as the entry's, or the current one (a new flow's). */
static __always_inline struct dp_ct_val *ct6_to_guest(struct dp_ct6_key *key, __u32 ifindex,
						      __u64 gen)
{
	key->gaddr = guest_fixed6(ifindex) ? DP_GADDR_FIXED : DP_GADDR_SLAAC;
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, key);
	if (v)
		return v;
	key->gaddr ^= 1; /* DP_GADDR_FIXED <-> DP_GADDR_SLAAC */
	v = bpf_map_lookup_elem(&ct6, key);
	if (v && v->gen == gen && v->kind == DP_CT_PORTMAP)
		return v;
	key->gaddr ^= 1;
	return NULL;
}

/* The guest's address a NAT66 flow was sent from. */
static __always_inline void v6_guest_addr(__u32 *a, __u8 gaddr, const struct dp_config *c)
{
	if (gaddr == DP_GADDR_FIXED)
		v6_fixed(a, DP_V6_GUEST_LO);
	else
		v6_eui64(a, DP_V6_PREFIX0, DP_V6_PREFIX1, c->guest_mac);
}
