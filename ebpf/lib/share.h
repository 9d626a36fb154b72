// SPDX-License-Identifier: GPL-2.0
/* A sandbox's share of the host-flow tables (sb_share, share_pool): its
 * guaranteed entries, the shared pool up to a cap, taken and given back.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Takes one host-flow entry of the sandbox on `ifindex`'s share: one of
 * its guaranteed ones, else one of the shared pool up to its cap. 0 or -1
 * (nothing taken). A device without an sb_share entry (bound by a build
 * before shares) is not limited. The check and the count are two steps
 * (the instruction set this object targets has no fetching atomics), so
 * CPUs racing for the last entries may each take one: a share can be
 * exceeded by at most the number of CPUs. Global functions (these three):
 * the verifier checks each once, not along every path that calls it. */
/* One budget of a sandbox's share (dp_share): `in` (flows others opened)
 * or the guest's own; its guaranteed entries and its cap. */
static __always_inline __u32 budget_guaranteed(const struct dp_config *c, __u32 in)
{
	__u32 own = (c->hflow_guaranteed + 1) / 2;
	return in ? c->hflow_guaranteed - own : own;
}

static __always_inline __u32 budget_cap(const struct dp_config *c)
{
	__u32 cap = c->hflow_cap / 2;
	return cap ? cap : 1;
}

/* Takes an entry of the sandbox's budget `in` (1: a flow someone else
 * opened to it; 0: one the guest opened): 0, or -1 when it is used up. */
__noinline int share_take(__u32 ifindex, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (!s || !c)
		return 0;
	__u32 v = s->hflow;
	__u32 held = in ? v >> 16 : v & 0xffff;
	if (held >= budget_cap(c))
		return -1;
	if (held >= budget_guaranteed(c, in)) {
		__u32 zero = 0;
		struct dp_share_pool *p = bpf_map_lookup_elem(&share_pool, &zero);
		if (!p)
			return -1;
		__u32 all = p->hflow_borrowed, others = p->hflow_borrowed_in;
		__u32 mine = in ? others : all - others;
		if (all >= c->hflow_borrow || mine >= c->hflow_borrow / 2)
			return -1;
		__sync_fetch_and_add(&p->hflow_borrowed, 1);
		if (in)
			__sync_fetch_and_add(&p->hflow_borrowed_in, 1);
	}
	__sync_fetch_and_add(&s->hflow, in ? 0x10000 : 1);
	return 0;
}

/* Gives one of `s`'s budget `in` back. */
static __always_inline void give(const struct dp_config *c, struct dp_share *s, __u32 in)
{
	__u32 v = s->hflow;
	__u32 held = in ? v >> 16 : v & 0xffff;
	if (held == 0)
		return; /* never below zero (the reaper's recount may have raced) */
	__sync_fetch_and_add(&s->hflow, in ? -0x10000 : -1);
	if (held > budget_guaranteed(c, in)) {
		__u32 zero = 0;
		struct dp_share_pool *p = bpf_map_lookup_elem(&share_pool, &zero);
		if (p && p->hflow_borrowed > 0)
			__sync_fetch_and_add(&p->hflow_borrowed, -1);
		if (p && in && p->hflow_borrowed_in > 0)
			__sync_fetch_and_add(&p->hflow_borrowed_in, -1);
	}
}

/* Gives one back (an entry share_take counted was removed). */
__noinline int share_give(__u32 ifindex, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s && c)
		give(c, s, in);
	return 0;
}

/* A host flow of the sandbox at `sandbox_ip`, opened by its owner of
 * generation `gen`, was removed: the owner (if it still owns the address)
 * gets the entry's share back. */
__noinline int hflow_gone(__u32 sandbox_ip, __u64 gen, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_tap *t = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!c || !t || t->gen != gen)
		return 0;
	__u32 ifindex = t->ifindex;
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s)
		give(c, s, in);
	return 0;
}

/* Which budget of its sandbox's share a host flow counts against: 1 for
 * one the node (or a local process through a mapping) opened. */
static __always_inline __u32 hflow_budget(const struct dp_hflow_val *v)
{
	return (v->flags & DP_HFF_HOST_OPENED) || v->kind == DP_HF_LO;
}
