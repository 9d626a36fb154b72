// SPDX-License-Identifier: GPL-2.0
/* NAT66: the IPv6 twins of the SNAT path (ct6, ct_rev6): keys, stale
 * flows, port allocation and rescue, and the live flow a reply belongs to.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* ---- NAT66 (docs/dual-stack.md): the IPv6 twins of the SNAT path ---- */

static __always_inline void ct6_key_of(struct dp_ct6_key *k, const struct dp_rev6_key *rk,
				       const struct dp_rev_val *rv)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->sandbox_ip = rv->sandbox_ip;
	__builtin_memcpy(k->remote_ip, rk->remote_ip, 16);
	k->guest_port = rv->guest_port;
	k->remote_port = rk->remote_port;
	k->proto = rk->proto;
	k->gaddr = (__u8)rv->pad;
}

/* The reverse key of a NAT66 flow, its NAT port still to be set. */
static __always_inline void rev6_of(const struct dp_ct6_key *key, struct dp_rev6_key *rk)
{
	__builtin_memset(rk, 0, sizeof(*rk));
	__builtin_memcpy(rk->remote_ip, key->remote_ip, 16);
	rk->remote_port = key->remote_port;
	rk->proto = key->proto;
}

/* As drop_stale, for NAT66 flows. */
static __always_inline void drop_stale6(const struct dp_ct6_key *k, const struct dp_ct_val *v)
{
	struct dp_rev6_key rk;
	rev6_of(k, &rk);
	rk.nat_port = v->nat_port;
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev6, &rk);
	if (rv && rv->gen == v->gen && rv->sandbox_ip == k->sandbox_ip &&
	    rv->guest_port == k->guest_port && rv->pad == k->gaddr)
		bpf_map_delete_elem(&ct_rev6, &rk);
	bpf_map_delete_elem(&ct6, k);
}

/* As snat_port_reusable, for NAT66 tuples (no host connections here:
 * to_uplink drops a node packet on a tuple a sandbox flow holds). */
static __always_inline int snat6_port_reusable(const struct dp_rev6_key *rk,
					       const struct syn_info *si)
{
	struct dp_rev_val *old = bpf_map_lookup_elem(&ct_rev6, rk);
	if (!old)
		return 1;
	__u32 old_ip = old->sandbox_ip;
	__u64 old_gen = old->gen;
	struct dp_ct6_key ok;
	ct6_key_of(&ok, rk, old);
	struct dp_ct_val *ov = bpf_map_lookup_elem(&ct6, &ok);
	if (!ov || ov->gen != old_gen || ov->nat_port != rk->nat_port)
		return 1; /* the reverse entry outlived its flow */
	struct dp_tap *owner = bpf_map_lookup_elem(&by_ip, &old_ip);
	int reopen = si->syn && rk->proto == IPPROTO_TCP;
	if (owner && owner->gen == old_gen &&
	    !(reopen && tcp_closed(ov->state) && time_wait_accepts(ov, si->ts, si->seq)))
		return 0;
	bpf_map_delete_elem(&ct6, &ok);
	return 1;
}

static __always_inline __u32 nat6_hash(const struct dp_ct6_key *key)
{
	return bpf_ntohs(key->guest_port) + (key->sandbox_ip + key->gaddr) * 2654435761u;
}

/* As snat_alloc and tuple_alloc: the NAT66 port of a new flow, from the
 * SNAT range, claimed in ct_rev6; a port whose reply tuple a host socket
 * would receive is skipped. */
__noinline int snat6_alloc(struct __sk_buff *skb, const struct dp_ct6_key *key, __u64 gen,
			   const struct syn_info *si, __u16 *nat_port)
{
	struct dp_config *c = get_config();
	if (!skb || !key || !si || !nat_port || !c)
		return -1;
	__u32 range = snat_range(c);
	if (!range)
		return -1;
	struct dp_rev_val rv = {
		.sandbox_ip = key->sandbox_ip,
		.guest_port = key->guest_port,
		.pad = key->gaddr,
		.gen = gen,
	};
	struct dp_rev6_key rk;
	rev6_of(key, &rk);
	__u32 h = nat6_hash(key);
	for (int i = 0; i < 32; i++) {
		__u16 p = snat_probe(c, range, h, i);
		if (p == 0)
			continue;
		rk.nat_port = p;
		if (bpf_map_update_elem(&ct_rev6, &rk, &rv, BPF_NOEXIST) != 0) {
			if (!snat6_port_reusable(&rk, si) ||
			    bpf_map_update_elem(&ct_rev6, &rk, &rv, BPF_ANY) != 0)
				continue;
			struct dp_rev_val *won = bpf_map_lookup_elem(&ct_rev6, &rk);
			if (!won || won->sandbox_ip != rv.sandbox_ip ||
			    won->guest_port != rv.guest_port || won->pad != rv.pad ||
			    won->gen != rv.gen)
				continue;
		}
		if (host_socket6(skb, key->proto, key->remote_ip, key->remote_port,
				 c->uplink_ip6, p)) {
			bpf_map_delete_elem(&ct_rev6, &rk);
			continue;
		}
		*nat_port = p;
		return 0;
	}
	return -1;
}

/* As snat_rescue: the port of a live NAT66 flow whose ct6 entry the LRU
 * evicted, from its reverse entry. */
__noinline int snat6_rescue(const struct dp_ct6_key *key, __u64 gen, __u16 *nat_port)
{
	struct dp_config *c = get_config();
	if (!key || !nat_port || !c)
		return -1;
	__u32 range = snat_range(c);
	if (!range)
		return -1;
	struct dp_rev6_key rk;
	rev6_of(key, &rk);
	__u32 h = nat6_hash(key);
	for (int i = 0; i < 32; i++) {
		__u16 p = snat_probe(c, range, h, i);
		if (p == 0)
			continue;
		rk.nat_port = p;
		struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev6, &rk);
		if (rv && rv->sandbox_ip == key->sandbox_ip && rv->guest_port == key->guest_port &&
		    rv->pad == key->gaddr && rv->gen == gen) {
			*nat_port = p;
			return 0;
		}
	}
	return -1;
}

/* The live NAT66 flow whose replies have the tuple `rk`: its forward key
 * in `k` and entry in `*vp`, and its sandbox's TAP; NULL when there is
 * none (a reverse entry that outlived its flow, or a released sandbox's
 * flow: removed). */
static __always_inline struct dp_tap *nat66_flow(const struct dp_rev6_key *rk,
						 struct dp_ct6_key *k, struct dp_ct_val **vp)
{
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev6, rk);
	if (!rv)
		return NULL;
	__u32 sandbox_ip = rv->sandbox_ip;
	__u64 gen = rv->gen;
	ct6_key_of(k, rk, rv);
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, k);
	if (!v || v->gen != gen || v->nat_port != rk->nat_port) {
		bpf_map_delete_elem(&ct_rev6, rk);
		return NULL;
	}
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap || tap->gen != gen) {
		drop_stale6(k, v);
		return NULL;
	}
	*vp = v;
	return tap;
}
