// SPDX-License-Identifier: GPL-2.0
/* The flow log (docs/flows.md): a flow's first packet and every refusal
 * become an event in the flow_events ring, within the sandbox's token
 * bucket (in its sb_stats entry); a flow's totals are counted in its
 * flow entry (flow_count, called by touch) and read by the agent's reaper
 * at the flow's end.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* A packet of flow `v` going `dir` (DIR_OUT: from the sandbox): its IP
 * bytes and packets. A GSO packet counts as the segments it leaves as,
 * each with the first's headers. Atomic: a flow's packets may run on
 * several CPUs at once. */
static __always_inline void flow_count(struct __sk_buff *skb, struct dp_ct_val *v,
				       const struct l4info *l4, int dir)
{
	/* Only with the flow log on: off, the forwarding path does what the
	 * builds before it did (cube-dpbench's flow-log rows measure both). */
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_FLOW_EVENTS))
		return;
	__u32 segs = skb->gso_segs;
	__u64 bytes = skb->len > ETH_HLEN ? skb->len - ETH_HLEN : 0;
	if (segs > 1) {
		__u32 hdr = l4->off - ETH_HLEN +
			    (l4->proto == IPPROTO_TCP ? l4->tcp_doff * 4 : 8);
		bytes += (__u64)(segs - 1) * hdr;
	} else {
		segs = 1;
	}
	if (!v->start_ns)
		v->start_ns = v->last_seen_ns;
	if (dir == DIR_OUT) {
		__sync_fetch_and_add(&v->bytes_out, bytes);
		__sync_fetch_and_add(&v->pkts_out, segs);
	} else {
		__sync_fetch_and_add(&v->bytes_in, bytes);
		__sync_fetch_and_add(&v->pkts_in, segs);
	}
}

/* A sandbox's rate (GCRA on the theoretical arrival time `*tat`): at most
 * flow_burst at once, one per flow_interval_ns after. 1: taken. A race of
 * two CPUs may let one more through. */
static __always_inline int gcra_take(__u64 *tat, const struct dp_config *c)
{
	__u64 now = bpf_ktime_get_ns();
	__u64 interval = c->flow_interval_ns;
	__u64 t = *tat > now ? *tat : now;
	if (t - now > interval * c->flow_burst)
		return 0;
	*tat = t + interval;
	return 1;
}

/* flow_note's `what`: the event's kind, reason, direction and way. */
static __always_inline __u32 fe_what(__u8 kind, __u8 reason, __u8 dir, __u8 via);
__noinline int flow_note(struct __sk_buff *skb, __u32 ifindex, __u32 what, __u32 port);

/* Flow `v`'s tuple starts another connection (a SYN after it closed):
 * its totals start again, and one the sandbox opens is recorded as a new
 * flow (by the packet going out, before it is translated). */
static __always_inline void flow_reopen(struct __sk_buff *skb, struct dp_ct_val *v, int dir)
{
	/* The closed flow's end first, with its totals (the reaper may not
	 * have seen it closed yet: a guest reusing its port at once). */
	__u32 zero = 0;
	struct dp_flow_totals *t = bpf_map_lookup_elem(&flow_scratch, &zero);
	if (t && dir == DIR_OUT && v->kind == DP_CT_SNAT && v->pkts_out) {
		t->start_ns = v->start_ns;
		t->bytes_out = v->bytes_out;
		t->bytes_in = v->bytes_in;
		t->pkts_out = v->pkts_out;
		t->pkts_in = v->pkts_in;
		flow_note(skb, skb->ifindex, fe_what(DP_FE_END, 0, DP_FD_EGRESS, DP_FV_SNAT),
			  v->nat_port);
	}
	v->start_ns = v->last_seen_ns;
	v->bytes_out = 0;
	v->bytes_in = 0;
	v->pkts_out = 0;
	v->pkts_in = 0;
	if (dir == DIR_OUT && v->kind == DP_CT_SNAT)
		flow_note(skb, skb->ifindex, fe_what(DP_FE_START, 0, DP_FD_EGRESS, DP_FV_SNAT),
			  v->nat_port);
}

static __always_inline __u32 fe_what(__u8 kind, __u8 reason, __u8 dir, __u8 via)
{
	return kind | ((__u32)reason << 8) | ((__u32)dir << 16) | ((__u32)via << 24);
}
#define FE_REFUSED(reason) fe_what(DP_FE_REFUSED, reason, DP_FD_EGRESS, DP_FV_NONE)

/* One event about the packet in `skb` (as it is now: before any rewrite)
 * of the sandbox on `ifindex`: `what` (fe_what); `port` is the node's
 * port of a new SNAT flow, or the guest's port of a flow others open
 * (network order). The sandbox's bucket decides (a lost event is
 * counted); the packet's headers are read into the ring's record. Its
 * direction says which end of the packet is the guest's: the source for
 * DP_FD_EGRESS and DP_FV_TO_GATEWAY, the destination otherwise. A global
 * function: verified once, its stack its own. */
__noinline int flow_note(struct __sk_buff *skb, __u32 ifindex, __u32 what, __u32 port)
{
	struct dp_config *c = get_config();
	if (!skb || !c || !(c->flags & DP_CFG_FLOW_EVENTS))
		return 0;
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (!s)
		return 0;
	if (!gcra_take(&s->flow_tat, c)) {
		__sync_fetch_and_add(&s->flow_lost, 1);
		return 0;
	}
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb)
		return 0;
	struct dp_flow_event *e = bpf_ringbuf_reserve(&flow_events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&s->flow_lost, 1);
		return 0;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = bpf_ktime_get_ns();
	e->gen = sb->gen;
	e->ifindex = ifindex;
	e->sandbox_ip = sb->sandbox_ip;
	e->kind = (__u8)what;
	e->reason = (__u8)(what >> 8);
	e->dir = (__u8)(what >> 16);
	e->via = (__u8)(what >> 24);
	if (e->kind == DP_FE_END) {
		__u32 zero = 0;
		struct dp_flow_totals *t = bpf_map_lookup_elem(&flow_scratch, &zero);
		if (t) {
			e->start_ns = t->start_ns;
			e->bytes_out = t->bytes_out;
			e->bytes_in = t->bytes_in;
			e->pkts_out = t->pkts_out;
			e->pkts_in = t->pkts_in;
		}
	}
	int guest_is_src = e->dir == DP_FD_EGRESS || e->via == DP_FV_TO_GATEWAY;
	/* Everything read from the packet goes straight into the record: the
	 * callers' stacks are deep, this frame stays (almost) empty. */
	__u32 *src = guest_is_src ? e->guest_ip : e->remote_ip;
	__u32 *dst = guest_is_src ? e->remote_ip : e->node_ip;
	__u32 l4_off = 0;
	if (bpf_skb_load_bytes(skb, 12, &e->pad, 2))
		goto out;
	if (e->pad == bpf_htons(ETH_P_IP)) {
		/* version/IHL into pad, fragment offset into node_port. */
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &e->pad, 1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 6, &e->node_port, 2) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 9, &e->proto, 1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 12, src, 4) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 16, dst, 4))
			goto out;
		e->family = 4;
		if (!(e->node_port & bpf_htons(0x1fff)))
			l4_off = ETH_HLEN + (e->pad & 0xf) * 4;
	} else if (e->pad == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN + 6, &e->proto, 1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 8, src, 16) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + 24, dst, 16))
			goto out;
		e->family = 6;
		l4_off = ETH_HLEN + 40;
	} else {
		goto out;
	}
	e->pad = 0;
	e->node_port = 0;
	/* The source port into guest_port, the destination's into
	 * remote_port (adjacent); moved below where the guest is the
	 * destination. */
	if (l4_off && (e->proto == IPPROTO_TCP || e->proto == IPPROTO_UDP)) {
		if (bpf_skb_load_bytes(skb, l4_off, &e->guest_port, 4))
			e->guest_port = e->remote_port = 0;
	} else if (l4_off && (e->proto == IPPROTO_ICMP || e->proto == IPPROTO_ICMPV6)) {
		/* An echo's identifier on the guest's side. */
		if (bpf_skb_load_bytes(skb, l4_off + 4, guest_is_src ? &e->guest_port : &e->remote_port,
				       2))
			e->guest_port = e->remote_port = 0;
	}
	if (guest_is_src) {
		if (e->kind != DP_FE_REFUSED && e->via == DP_FV_SNAT) {
			if (e->family == 4)
				e->node_ip[0] = c->uplink_ip;
			else
				__builtin_memcpy(e->node_ip, c->uplink_ip6, 16);
			e->node_port = (__u16)port;
		}
	} else {
		__u16 sport = e->guest_port, dport = e->remote_port;
		e->remote_port = sport;
		e->node_port = dport;
		e->guest_port = port ? (__u16)port : dport;
		if (e->family == 4) {
			e->guest_ip[0] = c->guest_ip;
		} else {
			e->guest_ip[0] = bpf_htonl(DP_V6_PREFIX0);
			e->guest_ip[1] = bpf_htonl(DP_V6_PREFIX1);
			e->guest_ip[3] = bpf_htonl(DP_V6_GUEST_LO);
		}
	}
out:
	bpf_ringbuf_submit(e, 0);
	__sync_fetch_and_add(&s->flow_sent, 1);
	return 0;
}

