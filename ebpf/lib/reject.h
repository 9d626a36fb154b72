// SPDX-License-Identifier: GPL-2.0
/* Refusals (docs/flows.md): a refused packet is noted in the flow log and
 * dropped, or, with deny_action "reject" (DP_CFG_REJECT) and a refusal of
 * the sandbox's egress (its policy, the node's own addresses), answered:
 * a TCP SYN with the RST a closed port sends, anything else with an
 * ICMP/ICMPv6 "administratively prohibited" from the gateway, within the
 * sandbox's rate (its sb_stats reject_tat). A spoofed source is never
 * answered (its refusal never asks for one).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Whether the sandbox on `ifindex` gets an answer now: deny_action is
 * "reject" and its rate allows (GCRA, the flow log's rate). */
static __always_inline int reject_ok(__u32 ifindex)
{
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_REJECT))
		return 0;
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (!s)
		return 0;
	return gcra_take(&s->reject_tat, c);
}

/* The guest's IPv4 packet in `skb` (not a TCP SYN: stale_reset answers
 * those) becomes an ICMP destination unreachable, communication
 * administratively prohibited (3/13), from the gateway, quoting its IP
 * header and first 8 bytes, sent back into the guest's device. Never an
 * error about an ICMP error. A global function: its stack is its own. */
__noinline int reject4(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	struct {
		struct iphdr ip;
		__u8 l4[8];
	} h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || h.ip.ihl != 5)
		return TC_ACT_SHOT;
	if (h.ip.protocol == IPPROTO_ICMP && h.l4[0] != ICMP_ECHO)
		return TC_ACT_SHOT;
	struct {
		struct iphdr ip;
		struct icmphdr ic;
	} r;
	__builtin_memset(&r, 0, sizeof(r));
	r.ip.version = 4;
	r.ip.ihl = 5;
	r.ip.tot_len = bpf_htons(sizeof(r) + sizeof(h));
	r.ip.ttl = 64;
	r.ip.protocol = IPPROTO_ICMP;
	r.ip.saddr = c->gateway_ip;
	r.ip.daddr = h.ip.saddr;
	r.ip.check = ~csum_fold32(csum_words(&r.ip, sizeof(r.ip)));
	r.ic.type = 3;  /* destination unreachable */
	r.ic.code = 13; /* communication administratively prohibited */
	r.ic.checksum = ~csum_fold32(csum_words(&r.ic, sizeof(r.ic)) + csum_words(&h, sizeof(h)));
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(r) + sizeof(h), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, &r, sizeof(r), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(r), &h, sizeof(h), 0) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	skb->priority = DP_TAP_CLASS_SMALL;
	return bpf_redirect(skb->ifindex, 0);
}

/* A guest's IPv4 packet refused for `reason` (DP_FR_*): noted; answered
 * if it is a refusal of its egress and deny_action says so. A global
 * function: verified once (inlined at every refusal, the answers' code
 * multiplied from_guest's verification). */
__noinline int refuse4(struct __sk_buff *skb, __u32 ifindex, __u32 reason)
{
	if (!skb)
		return TC_ACT_SHOT;
	flow_note(skb, ifindex, FE_REFUSED(reason), 0);
	if ((reason == DP_FR_POLICY || reason == DP_FR_NODE_ADDR) && reject_ok(ifindex)) {
		__u8 proto = 0, flags = 0;
		if (!bpf_skb_load_bytes(skb, ETH_HLEN + 9, &proto, 1) && proto == IPPROTO_TCP &&
		    !bpf_skb_load_bytes(skb, ETH_HLEN + 20 + 13, &flags, 1) &&
		    (flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN)
			return stale_reset(skb);
		return reject4(skb);
	}
	return TC_ACT_SHOT;
}

static __always_inline int refused(struct __sk_buff *skb, __u32 ifindex, __u8 reason)
{
	return refuse4(skb, ifindex, reason);
}

/* skb->cb[0] of a tail call to guest6_rst that is a reject (an RST for a
 * TCP SYN, else ICMPv6 administratively prohibited), not a stale flow's
 * RST. */
#define CB_REJECT6 0x72656a36u

/* refused() for a guest's IPv6 packet, in guest6_out or guest6_steer
 * (tail calls of their own: the answer is guest6_rst's). */
static __always_inline int refused6(struct __sk_buff *skb, __u32 ifindex, __u8 reason)
{
	flow_note(skb, ifindex, FE_REFUSED(reason), 0);
	if ((reason == DP_FR_POLICY || reason == DP_FR_NODE_ADDR) && reject_ok(ifindex)) {
		skb->cb[0] = CB_REJECT6;
		bpf_tail_call(skb, &tails, TAIL_GUEST6_RST);
	}
	return TC_ACT_SHOT;
}
