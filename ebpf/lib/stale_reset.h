// SPDX-License-Identifier: GPL-2.0
/* TCP segments of connections the sandbox never opened: answered with
 * the RST a closed port sends (stale_reset).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* The TCP header (no options, checksum 0) of the RST a closed port sends
 * for segment `th` carrying `payload` bytes (RFC 9293 3.10.7.1: SEQ = its
 * ACK, else RST|ACK acknowledging it). */
static __always_inline void rst_for(const struct tcphdr *th, __u32 payload, struct tcphdr *r)
{
	__builtin_memset(r, 0, sizeof(*r));
	r->source = th->dest;
	r->dest = th->source;
	r->doff = 5;
	r->rst = 1;
	if (th->ack) {
		r->seq = th->ack_seq;
	} else {
		r->ack = 1;
		r->ack_seq = bpf_htonl(bpf_ntohl(th->seq) + payload + th->syn + th->fin);
	}
}

/* A guest's TCP segment (not an RST) of a connection this sandbox never
 * opened (a guest restored from a snapshot keeps its connections; their
 * flows belong to the sandbox it was snapshotted in, or to no one): the
 * frame is turned into the RST a closed port answers with (RFC 9293
 * 3.10.7.1: SEQ = the segment's ACK, else ACK = its end) and sent back
 * to the guest, so the connection ends within a round trip instead of
 * leaving with a new SNAT port and hanging until the guest gives up.
 * Whether the frame has a partial checksum (a VMM's TAP offload: the
 * guest's side sums the header) is asked of the kernel: a checksum
 * update of a non-pseudo-header word changes the field only when the
 * checksum is complete. */
__noinline int stale_reset(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	struct {
		struct iphdr ip;
		struct tcphdr th;
	} h, r;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || h.ip.ihl != 5 ||
	    h.ip.protocol != IPPROTO_TCP || h.th.rst)
		return TC_ACT_SHOT;
	int partial = l4_partial(skb, ETH_HLEN + sizeof(struct iphdr) +
					   __builtin_offsetof(struct tcphdr, check));
	if (partial < 0)
		return TC_ACT_SHOT;

	__u32 tot = bpf_ntohs(h.ip.tot_len);
	__u32 hdrs = sizeof(struct iphdr) + h.th.doff * 4;
	__builtin_memset(&r.ip, 0, sizeof(r.ip));
	r.ip.version = 4;
	r.ip.ihl = 5;
	r.ip.tot_len = bpf_htons(sizeof(r));
	r.ip.frag_off = bpf_htons(0x4000); /* DF */
	r.ip.ttl = 64;
	r.ip.protocol = IPPROTO_TCP;
	r.ip.saddr = h.ip.daddr;
	r.ip.daddr = h.ip.saddr;
	r.ip.check = ~csum_fold32(csum_words(&r.ip, sizeof(r.ip)));
	rst_for(&h.th, tot > hdrs ? tot - hdrs : 0, &r.th);
	__u32 pseudo = (r.ip.saddr >> 16) + (r.ip.saddr & 0xffff) + (r.ip.daddr >> 16) +
		       (r.ip.daddr & 0xffff) + bpf_htons(IPPROTO_TCP) + bpf_htons(sizeof(r.th));
	if (partial)
		r.th.check = csum_fold32(pseudo);
	else
		r.th.check = ~csum_fold32(pseudo + csum_words(&r.th, sizeof(r.th)));
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(r), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, &r, sizeof(r), 0) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	skb->priority = DP_TAP_CLASS_SMALL;
	return bpf_redirect(skb->ifindex, 0);
}
