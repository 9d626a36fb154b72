// SPDX-License-Identifier: GPL-2.0
/* guest6_rst (tail call of guest6_out and guest6_steer): the RST for a
 * guest's TCP segment of an IPv6 flow it never opened.
 * Part of datapath.bpf.c's one translation unit (see there). */

/* A guest's TCP segment to the IPv6 world of a flow it never opened gets
 * the RST a closed port sends (guest6_out counted it as stale). */
SEC("classifier")
int guest6_rst(struct __sk_buff *skb)
{
	return answer6(skb, skb->cb[0] == CB_REJECT6 ? V6_REJECT : V6_REFUSE_QUIET);
}
