// SPDX-License-Identifier: GPL-2.0
/* Paused sandboxes: a packet for one is dropped, and the first of each
 * pause wakes the agent (wake_sent, the wakes ring).
 * Part of datapath.bpf.c's one translation unit (see there). */

/* A packet for a paused sandbox is dropped (the sender retransmits;
 * docs/design.md "Paused sandboxes"); the first one of each pause is
 * reported: `wake_sent` takes it only if empty (the agent empties it
 * when it arms a pause), and the ring tells the agent. A full ring gives
 * the slot back, so the next packet tries again. `what`: the sandbox's
 * port (bits 0-15), the sender's port (16-31), protocol (32-39) and
 * DP_WAKE_* (40-47). A global function: verified once. */
__noinline int paused_drop(__u32 ifindex, __u64 gen, __u32 sandbox_ip, __u32 remote_ip,
			   __u64 what)
{
	struct dp_wake w = {
		.gen = gen,
		.sandbox_ip = sandbox_ip,
		.ifindex = ifindex,
		.remote_ip = remote_ip,
		.port = (__u16)what,
		.remote_port = (__u16)(what >> 16),
		.proto = (__u8)(what >> 32),
		.kind = (__u8)(what >> 40),
	};
	if (bpf_map_update_elem(&wake_sent, &ifindex, &w, BPF_NOEXIST) == 0 &&
	    bpf_ringbuf_output(&wakes, &w, sizeof(w), 0) != 0)
		bpf_map_delete_elem(&wake_sent, &ifindex);
	count(DP_C_PAUSED_DROP);
	return TC_ACT_SHOT;
}

/* paused_drop for a packet from an IPv6 sender (`remote`): its report
 * names the sender's IPv6 address (struct dp_wake6). */
__noinline int paused_drop6(__u32 ifindex, __u64 gen, __u32 sandbox_ip, const struct dp_in6 *remote,
			    __u64 what)
{
	struct dp_wake6 w = {
		.w = {
			.gen = gen,
			.sandbox_ip = sandbox_ip,
			.ifindex = ifindex,
			.port = (__u16)what,
			.remote_port = (__u16)(what >> 16),
			.proto = (__u8)(what >> 32),
			.kind = (__u8)(what >> 40),
		},
	};
	if (remote)
		__builtin_memcpy(w.remote_ip6, remote->w, 16);
	if (bpf_map_update_elem(&wake_sent, &ifindex, &w.w, BPF_NOEXIST) == 0 &&
	    bpf_ringbuf_output(&wakes, &w, sizeof(w), 0) != 0)
		bpf_map_delete_elem(&wake_sent, &ifindex);
	count(DP_C_PAUSED_DROP);
	return TC_ACT_SHOT;
}

static __always_inline __u64 wake_what(__u16 port, __u16 remote_port, __u8 proto, __u8 kind)
{
	return (__u64)port | ((__u64)remote_port << 16) | ((__u64)proto << 32) |
	       ((__u64)kind << 40);
}
