// SPDX-License-Identifier: GPL-2.0
/* Proxy ARP: the guest's ARP requests answered with the gateway MAC.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* Proxy ARP: every request from the guest (except for its own address:
 * duplicate address detection) is answered with the gateway MAC. */
static __always_inline int proxy_arp(struct __sk_buff *skb, const struct dp_config *c)
{
	struct {
		struct arphdr h;
		__u8 sha[6];
		__u8 spa[4];
		__u8 tha[6];
		__u8 tpa[4];
	} __attribute__((packed)) arp;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &arp, sizeof(arp))) {
		count(DP_C_MALFORMED);
		sb_count(skb->ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (arp.h.ar_hrd != bpf_htons(ARPHRD_ETHER) || arp.h.ar_pro != bpf_htons(ETH_P_IP) ||
	    arp.h.ar_hln != 6 || arp.h.ar_pln != 4 || arp.h.ar_op != bpf_htons(ARPOP_REQUEST))
		return TC_ACT_SHOT;
	if (!mac_eq(arp.sha, c->guest_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count(skb->ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	__u32 spa, tpa;
	__builtin_memcpy(&spa, arp.spa, 4);
	__builtin_memcpy(&tpa, arp.tpa, 4);
	if ((spa != c->guest_ip && spa != 0) || tpa == c->guest_ip || tpa == 0)
		return TC_ACT_SHOT;

	arp.h.ar_op = bpf_htons(ARPOP_REPLY);
	__builtin_memcpy(arp.tha, arp.sha, 6);
	__builtin_memcpy(arp.sha, c->gateway_mac, 6);
	__builtin_memcpy(arp.tpa, arp.spa, 4);
	__builtin_memcpy(arp.spa, &tpa, 4);
	if (bpf_skb_store_bytes(skb, ETH_HLEN, &arp, sizeof(arp), 0) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_ARP_REPLY);
	skb->priority = DP_TAP_CLASS_SMALL; /* ahead of bulk under a limit */
	return bpf_redirect(skb->ifindex, 0);
}
