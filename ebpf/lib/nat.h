// SPDX-License-Identifier: GPL-2.0
/* IPv4 SNAT and the flow tables (ct, ct_rev, host_nat's tuple space): a
 * flow of a sandbox's current owner, stale flows dropped, SNAT ports
 * allocated from the SNAT range (for sandbox flows and for the host's own
 * connections that clash with one) and rescued after an LRU eviction.
 * Part of datapath.bpf.c's one translation unit (see there). */

static __always_inline void touch(struct __sk_buff *skb, struct dp_ct_val *v,
				  const struct l4info *l4, int dir)
{
	__u8 old = v->state;
	v->last_seen_ns = bpf_ktime_get_ns();
	v->state = tcp_state(old, l4, dir);
	/* A SYN on a closed flow's tuple (TIME_WAIT reuse): a new connection,
	 * with totals and a start record of its own. */
	if (old && l4->proto == IPPROTO_TCP && (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN)
		flow_reopen(skb, v, dir);
	flow_count(skb, v, l4, dir);
}

/* Removes a flow that belongs to an earlier owner of its sandbox address
 * (or to a released sandbox), with its SNAT reverse entry if that still
 * points at it. */
static __always_inline void drop_stale(const struct dp_ct_key *k, const struct dp_ct_val *v)
{
	if (v->kind == DP_CT_SNAT) {
		struct dp_rev_key rk = {
			.remote_ip = k->remote_ip,
			.remote_port = k->remote_port,
			.nat_port = v->nat_port,
			.proto = k->proto,
		};
		struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
		if (rv && rv->gen == v->gen && rv->sandbox_ip == k->sandbox_ip &&
		    rv->guest_port == k->guest_port)
			bpf_map_delete_elem(&ct_rev, &rk);
	}
	bpf_map_delete_elem(&ct, k);
}

/* The flow `k` of the sandbox whose owner has generation `gen`: a flow
 * another owner of the address left behind is no flow (and is deleted),
 * so the new owner's packets open flows of their own. */
static __always_inline struct dp_ct_val *flow_of(const struct dp_ct_key *k, __u64 gen)
{
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct, k);
	if (v && v->gen != gen) {
		drop_stale(k, v);
		return NULL;
	}
	return v;
}

/* Whether the flow holding port rk->nat_port to this remote endpoint is
 * over, so a new flow may take the port: a sandbox flow whose forward
 * entry is gone (reaped) or is now another flow's, whose sandbox was
 * released or whose address has a new owner (generation), or a TCP flow
 * that is closed (RST, or FIN both ways) when `syn` opens a new TCP
 * connection (as the kernel reuses a TIME_WAIT tuple for a new SYN; not
 * before: the remote may still hold the old connection). A host
 * connection's tuple (sandbox_ip 0, see to_uplink) is held while its
 * host_nat entry lives. */
/* A new flow's SYN, what tuple reuse needs of it (see time_wait_accepts);
 * `syn` 0 = not a TCP SYN. */
struct syn_info {
	int syn;
	__u32 ts;
	__u32 seq;
};

static __always_inline int snat_port_reusable(const struct dp_rev_key *rk,
					      const struct syn_info *si)
{
	int syn = si->syn;
	struct dp_rev_val *old = bpf_map_lookup_elem(&ct_rev, rk);
	if (!old)
		return 1;
	int reopen = syn && rk->proto == IPPROTO_TCP;
	if (old->sandbox_ip == 0) {
		struct dp_rev_key hk = {
			.remote_ip = rk->remote_ip,
			.remote_port = rk->remote_port,
			.nat_port = old->guest_port,
			.proto = rk->proto,
		};
		struct dp_ct_val *hv = bpf_map_lookup_elem(&host_nat, &hk);
		if (!hv || hv->nat_port != rk->nat_port)
			return 1; /* the host connection is gone */
		if (!(reopen && tcp_closed(hv->state)))
			return 0;
		bpf_map_delete_elem(&host_nat, &hk);
		return 1;
	}
	__u32 old_ip = old->sandbox_ip;
	__u64 old_gen = old->gen;
	struct dp_ct_key ok = {
		.sandbox_ip = old_ip,
		.remote_ip = rk->remote_ip,
		.guest_port = old->guest_port,
		.remote_port = rk->remote_port,
		.proto = rk->proto,
	};
	struct dp_ct_val *ov = bpf_map_lookup_elem(&ct, &ok);
	if (!ov || ov->gen != old_gen || ov->nat_port != rk->nat_port || ov->kind != DP_CT_SNAT)
		return 1; /* the reverse entry outlived its flow */
	struct dp_tap *owner = bpf_map_lookup_elem(&by_ip, &old_ip);
	if (owner && owner->gen == old_gen &&
	    !(reopen && tcp_closed(ov->state) && time_wait_accepts(ov, si->ts, si->seq)))
		return 0;
	bpf_map_delete_elem(&ct, &ok);
	return 1;
}

/* The SNAT range's size; 0 when it is unusable. */
static __always_inline __u32 snat_range(const struct dp_config *c)
{
	if (c->snat_port_max < c->snat_port_min)
		return 0;
	return (__u32)c->snat_port_max - c->snat_port_min + 1;
}

/* Probe `i` of a flow's 32 into the SNAT range from `h` (steps of 7919,
 * a prime: every port of the range in turn); network order, 0: skip. */
static __always_inline __u16 snat_probe(const struct dp_config *c, __u32 range, __u32 h, int i)
{
	return bpf_htons(c->snat_port_min + (h + i * 7919u) % range);
}

/* Claims a port of the SNAT range for (remote, remote port, proto) in
 * ct_rev with value `rv`: up to 32 probes from `h` (then steps of 7919).
 * A port is free when no live flow to the same remote endpoint holds it
 * (claimed atomically with BPF_NOEXIST, or taken over from a flow that is
 * over) and no host socket (listeners included) would receive the reply
 * tuple (asked only for the port just claimed: a socket lookup costs more
 * than a map update). */
static __always_inline int tuple_alloc(struct __sk_buff *skb, const struct dp_config *c,
				       __u32 remote_ip, __u16 remote_port, __u8 proto,
				       const struct dp_rev_val *rv, __u32 h,
				       const struct syn_info *si, __u16 *nat_port)
{
	__u32 range = snat_range(c);
	if (!range)
		return -1;
	struct dp_rev_key rk = {
		.remote_ip = remote_ip,
		.remote_port = remote_port,
		.proto = proto,
	};
	for (int i = 0; i < 32; i++) {
		__u16 p = snat_probe(c, range, h, i);
		if (p == 0)
			continue;
		rk.nat_port = p;
		if (bpf_map_update_elem(&ct_rev, &rk, rv, BPF_NOEXIST) != 0) {
			if (!snat_port_reusable(&rk, si) ||
			    bpf_map_update_elem(&ct_rev, &rk, rv, BPF_ANY) != 0)
				continue;
			/* Another CPU may have taken the same port over at the
			 * same time: the port is ours only if the entry says so. */
			struct dp_rev_val *won = bpf_map_lookup_elem(&ct_rev, &rk);
			if (!won || won->sandbox_ip != rv->sandbox_ip ||
			    won->guest_port != rv->guest_port || won->gen != rv->gen)
				continue;
		}
		if (host_socket(skb, proto, remote_ip, remote_port, c->uplink_ip, p, 1)) {
			bpf_map_delete_elem(&ct_rev, &rk);
			continue;
		}
		*nat_port = p;
		return 0;
	}
	return -1;
}

/* Picks the SNAT port of a new sandbox flow, only ever from the SNAT range
 * (never the guest's own source port, which could be one the host's own
 * connections use). The first probe follows the guest's own port (its
 * kernel already spreads reuse of a port to one destination out in time),
 * offset per sandbox so two sandboxes using the same guest port do not
 * contend. */
__noinline int snat_alloc(struct __sk_buff *skb, const struct dp_ct_key *key, __u64 gen,
			  const struct syn_info *si, __u16 *nat_port)
{
	/* A global function: its 32 probes are verified once, not along
	 * every path of from_guest that opens a flow. */
	struct dp_config *c = get_config();
	if (!skb || !key || !si || !nat_port || !c)
		return -1;
	struct dp_rev_val rv = {
		.sandbox_ip = key->sandbox_ip,
		.guest_port = key->guest_port,
		.gen = gen,
	};
	__u32 h = bpf_ntohs(key->guest_port) + key->sandbox_ip * 2654435761u;
	return tuple_alloc(skb, c, key->remote_ip, key->remote_port, key->proto, &rv, h, si,
			   nat_port);
}

/* A port for a host connection (to_uplink) whose own port a sandbox flow
 * holds (hk: its tuple, nat_port = its own port). A global function: its
 * 32 probes are verified once, apart from to_uplink's paths. */
__noinline int host_tuple_alloc(struct __sk_buff *skb, const struct dp_rev_key *hk, __u32 h,
				const struct syn_info *si, __u16 *nat_port)
{
	struct dp_config *c = get_config();
	if (!skb || !hk || !si || !nat_port || !c)
		return -1;
	struct dp_rev_val rv = {.sandbox_ip = 0, .guest_port = hk->nat_port, .gen = 0};
	return tuple_alloc(skb, c, hk->remote_ip, hk->remote_port, hk->proto, &rv, h, si,
			   nat_port);
}

/* A packet that would open a new flow: no flow entry yet, or a TCP SYN. */
static __always_inline int opens_flow(const struct dp_ct_val *v, const struct l4info *l4)
{
	return !v || (l4->proto == IPPROTO_TCP &&
		      (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN);
}

/* A guest's TCP segment (not a SYN) with no flow entry may belong to a
 * live flow whose `ct` entry the LRU evicted while its reverse entry
 * lives: the reverse entry names the flow's SNAT port (probed as
 * tuple_alloc claims them). 0 and the port if so. */
__noinline int snat_rescue(const struct dp_ct_key *key, __u64 gen, __u16 *nat_port)
{
	struct dp_config *c = get_config();
	if (!key || !nat_port || !c)
		return -1;
	__u32 range = snat_range(c);
	if (!range)
		return -1;
	__u32 h = bpf_ntohs(key->guest_port) + key->sandbox_ip * 2654435761u;
	struct dp_rev_key rk = {
		.remote_ip = key->remote_ip,
		.remote_port = key->remote_port,
		.proto = key->proto,
	};
	for (int i = 0; i < 32; i++) {
		__u16 p = snat_probe(c, range, h, i);
		if (p == 0)
			continue;
		rk.nat_port = p;
		struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
		if (rv && rv->sandbox_ip == key->sandbox_ip && rv->guest_port == key->guest_port &&
		    rv->gen == gen) {
			*nat_port = p;
			return 0;
		}
	}
	return -1;
}
