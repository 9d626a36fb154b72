// SPDX-License-Identifier: GPL-2.0
/* TCP connection state as the flow tables track it: the state after a
 * segment (SYN, FIN, RST), timestamps, and TIME_WAIT reuse of a closed
 * flow's tuple.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The TCP state after a packet going `dir`: a SYN (re)opens, FIN and RST
 * add their bit; a FIN from the other end before ours means the other end
 * closes first and keeps the tuple in TIME_WAIT. */
static __always_inline __u8 tcp_state(__u8 state, const struct l4info *l4, int dir)
{
	if (l4->proto != IPPROTO_TCP)
		return state;
	if (l4->tcp_flags & TCP_SYN)
		state = DP_TCP_OPEN;
	if (l4->tcp_flags & TCP_RST)
		state |= DP_TCP_RST;
	if (l4->tcp_flags & TCP_FIN) {
		if (dir == DIR_OUT)
			state |= DP_TCP_FIN_OUT;
		else if (!(state & DP_TCP_FIN_OUT))
			state |= DP_TCP_FIN_IN | DP_TCP_REMOTE_TW;
		else
			state |= DP_TCP_FIN_IN;
	}
	return state;
}

/* The TCP timestamp value (TSval, host order; 0 = none) in the `len`
 * bytes of options at `base`, walked with one small load each (at most 20
 * options). A global function: the verifier checks it once, on its own,
 * instead of along every path of its callers. */
__noinline __u32 tcp_options_tsval(struct __sk_buff *skb, __u32 base, __u32 len)
{
	if (!skb || len > 40)
		return 0;
	__u32 i = 0;
	for (int n = 0; n < 20; n++) {
		if (i + 2 > len)
			break;
		__u8 kl[2];
		if (bpf_skb_load_bytes(skb, base + i, kl, 2))
			break;
		if (kl[0] == 0)
			break;
		if (kl[0] == 1) {
			i += 1;
			continue;
		}
		if (kl[0] == 8 && kl[1] == 10 && i + 10 <= len) {
			__u32 ts;
			if (bpf_skb_load_bytes(skb, base + i + 2, &ts, 4))
				break;
			return bpf_ntohl(ts);
		}
		if (kl[1] < 2)
			break;
		i += kl[1];
	}
	return 0;
}

static __always_inline __u32 tcp_tsval(struct __sk_buff *skb, const struct l4info *l4)
{
	__u32 len = l4->tcp_doff * 4;
	return len > 20 ? tcp_options_tsval(skb, l4->off + 20, len - 20) : 0;
}

/* What a closing flow sent last: the remote's TIME_WAIT judges a new SYN
 * on the same tuple against it. */
static __always_inline void note_close(struct __sk_buff *skb, struct dp_ct_val *v,
				       const struct l4info *l4)
{
	if (l4->proto != IPPROTO_TCP ||
	    !(v->state || (l4->tcp_flags & (TCP_FIN | TCP_RST))))
		return;
	__u32 ts = tcp_tsval(skb, l4);
	if (ts)
		v->ts_last = ts;
	v->seq_last = l4->tcp_end;
}

/* Whether a SYN (timestamp `syn_ts`, 0 = none; sequence `syn_seq`) would
 * be accepted on the tuple of the closed flow `v`: where the remote closed
 * first it keeps TIME_WAIT, and takes a new SYN there only with a newer
 * timestamp (without timestamps: a later sequence number). Each
 * connection's timestamps start at a random offset, so a closed flow's
 * tuple suits only some new connections (others take another port). */
static __always_inline int time_wait_accepts(const struct dp_ct_val *v, __u32 syn_ts,
					      __u32 syn_seq)
{
	if (!(v->state & DP_TCP_REMOTE_TW))
		return 1;
	if (syn_ts && v->ts_last)
		return (__s32)(syn_ts - v->ts_last) > 0;
	return (__s32)(syn_seq - v->seq_last) > 0;
}

/* Closed for good: reset, or finished both ways. */
static __always_inline int tcp_closed(__u8 state)
{
	return (state & DP_TCP_RST) ||
	       (state & (DP_TCP_FIN_OUT | DP_TCP_FIN_IN)) == (DP_TCP_FIN_OUT | DP_TCP_FIN_IN);
}
