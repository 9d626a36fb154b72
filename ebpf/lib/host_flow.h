// SPDX-License-Identifier: GPL-2.0
/* Host <-> sandbox flows (hflow, hrev): a flow's gateway-side port, its
 * entries made, continued and dropped, admission of node processes
 * (host_access), new flows the guest opens, delivery into the gateway
 * device, and the agent's service ports. Also the sandboxes' IPv6
 * identities (pool6) these flows use.
 * Part of datapath.bpf.c's one translation unit (see there). */

static __always_inline int hkey_eq(const struct dp_hflow_key *a, const struct dp_hflow_key *b)
{
	return a->saddr == b->saddr && a->daddr == b->daddr && a->sport == b->sport &&
	       a->dport == b->dport && a->proto == b->proto && a->family == b->family;
}

/* Removes a host flow and its guest-side entry if that still points at it. */
static __always_inline void hflow_drop(const struct dp_config *c, const struct dp_hflow_key *hk,
				       const struct dp_hflow_val *hv)
{
	__u32 sandbox_ip = hv->sandbox_ip;
	__u64 gen = hv->gen;
	__u32 in = hflow_budget(hv);
	struct dp_hrev_key rk = {
		.sandbox_ip = sandbox_ip,
		.guest_port = hv->guest_port,
		.gw_port = hv->gw_port,
		.proto = hk->proto,
		.family = hk->family,
	};
	struct dp_hrev_val *rv = bpf_map_lookup_elem(&hrev, &rk);
	if (rv && hkey_eq(&rv->host, hk))
		bpf_map_delete_elem(&hrev, &rk);
	if (bpf_map_delete_elem(&hflow, hk) == 0)
		hflow_gone(sandbox_ip, gen, in);
}

/* The host flow `hk` of the sandbox at `sandbox_ip` whose owner has
 * generation `gen`; one an earlier owner left behind is no flow (and is
 * deleted). */
static __always_inline struct dp_hflow_val *hflow_of(const struct dp_config *c,
						     const struct dp_hflow_key *hk,
						     __u32 sandbox_ip, __u64 gen)
{
	struct dp_hflow_val *hv = bpf_map_lookup_elem(&hflow, hk);
	if (hv && (hv->gen != gen || hv->sandbox_ip != sandbox_ip)) {
		hflow_drop(c, hk, hv);
		return NULL;
	}
	return hv;
}

/* Whether the guest-side tuple `rk` may go to a new host flow: nobody
 * holds it, its holder is gone (or an earlier owner's), or `syn` opens a
 * new TCP connection where the holder's is closed. */
static __always_inline int hrev_reusable(const struct dp_config *c, const struct dp_hrev_key *rk,
					 __u64 gen, int syn)
{
	struct dp_hrev_val *old = bpf_map_lookup_elem(&hrev, rk);
	if (!old)
		return 1;
	struct dp_hflow_key ok = old->host;
	struct dp_hflow_val *ov = bpf_map_lookup_elem(&hflow, &ok);
	if (!ov || ov->sandbox_ip != rk->sandbox_ip || ov->guest_port != rk->guest_port ||
	    ov->gw_port != rk->gw_port)
		return 1; /* the holder's flow is gone */
	if (ov->gen == gen && !(syn && rk->proto == IPPROTO_TCP && tcp_closed(ov->state)))
		return 0;
	__u32 held_by = ov->sandbox_ip;
	__u64 held_gen = ov->gen;
	__u32 in = hflow_budget(ov);
	if (bpf_map_delete_elem(&hflow, &ok) == 0)
		hflow_gone(held_by, held_gen, in);
	return 1;
}

/* The gateway-side port a new host -> sandbox flow shows the guest: the
 * host's own source port when no other flow to that guest port uses it
 * (what the guest sees is what the host sent), else another one, so two
 * host connections never share a tuple in the guest (the host's own
 * connections from one port over different addresses or paths would). */
static __always_inline int hflow_alloc(const struct dp_config *c, const struct dp_hflow_key *hk,
				       __u32 sandbox_ip, __u16 guest_port, __u64 gen, int syn,
				       __u16 *gw_port)
{
	struct dp_hrev_key rk = {
		.sandbox_ip = sandbox_ip,
		.guest_port = guest_port,
		.proto = hk->proto,
		.family = hk->family,
	};
	struct dp_hrev_val rv = {.host = *hk, .gen = gen};
	__u32 h = bpf_ntohs(hk->sport) + hk->saddr * 2654435761u;
	for (int i = 0; i < 16; i++) {
		__u16 p = i == 0 ? hk->sport : bpf_htons(1024 + (h + i * 7919u) % 64512);
		rk.gw_port = p;
		if (bpf_map_update_elem(&hrev, &rk, &rv, BPF_NOEXIST) != 0) {
			if (!hrev_reusable(c, &rk, gen, syn) ||
			    bpf_map_update_elem(&hrev, &rk, &rv, BPF_ANY) != 0)
				continue;
			/* Taken over on two CPUs at once: ours only if it says so. */
			struct dp_hrev_val *won = bpf_map_lookup_elem(&hrev, &rk);
			if (!won || !hkey_eq(&won->host, hk) || won->gen != gen)
				continue;
		}
		*gw_port = p;
		return 0;
	}
	return -1;
}

/* Whether the process that sent this packet may open a flow to a sandbox
 * address: root (also the kernel's own resets and ICMP errors, sent from
 * its control sockets), or a uid the operator granted (host_access). A
 * packet without a full socket (from TIME_WAIT, say) reports the overflow
 * uid 65534, which the agent never grants. Forwarded packets never get
 * here. */
static __always_inline int host_admitted(struct __sk_buff *skb)
{
	__u32 uid = bpf_get_socket_uid(skb);
	return uid == 0 || bpf_map_lookup_elem(&host_access, &uid) != NULL;
}

/* Whether a process without host access sent this packet: a full socket
 * whose uid is not admitted. A packet without one (a TIME_WAIT socket's
 * last ACK, a reset) is the kernel's own. */
static __always_inline int sent_by_unadmitted_process(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 0;
	if (!bpf_sk_fullsock(sk))
		return 0;
	return !host_admitted(skb);
}

/* Starts or continues the host flow `hk` (the host sending to the
 * sandbox's `guest_port`); its gateway-side port, or -1 (dropped): no
 * free port, the sandbox's share of host flows is used up, or (with
 * `admission`) a new flow from a process without host access. A packet
 * of a running flow leaves its entry in `*flow` (a DP_HF_PROXY one's peer
 * is where the reply comes from; its flags say which guest address it
 * has), NULL for one this packet opens: an IPv6 one has the guest's
 * current address (guest_fixed6). */
static __always_inline int hflow_in(struct __sk_buff *skb, const struct dp_config *c,
				    const struct dp_hflow_key *hk, __u32 sandbox_ip,
				    __u32 tap_ifindex, __u16 guest_port, __u64 gen, __u8 kind,
				    int admission, const struct l4info *l4, __u16 *gw_port,
				    struct dp_hflow_val **flow)
{
	struct dp_hflow_val *hv = hflow_of(c, hk, sandbox_ip, gen);
	*flow = NULL;
	if (hv && hv->guest_port == guest_port &&
	    (hv->kind == kind || (kind == DP_HF_GWDEV && hv->kind == DP_HF_PROXY))) {
		/* A flow the node opened stays its sender's: judged again on
		 * every packet (a flow the guest opened is answered by whoever
		 * listens). */
		if ((hv->flags & DP_HFF_HOST_OPENED) && sent_by_unadmitted_process(skb)) {
			count(DP_C_HOST_DENIED);
			return -1;
		}
		hv->last_seen_ns = bpf_ktime_get_ns();
		hv->state = tcp_state(hv->state, l4, DIR_IN);
		*gw_port = hv->gw_port;
		*flow = hv;
		return 0;
	}
	if (admission && !host_admitted(skb)) {
		count(DP_C_HOST_DENIED);
		return -1;
	}
	/* A SYN-ACK or a reset never opens a TCP flow: the kernel's answer to
	 * a connection someone forged "from" the sandbox is root's, and must
	 * not become a flow. (A plain segment does: a running connection whose
	 * idle entry the reaper removed goes on with the same tuple.) */
	if (l4->proto == IPPROTO_TCP &&
	    ((l4->tcp_flags & TCP_RST) ||
	     (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == (TCP_SYN | TCP_ACK))) {
		count(DP_C_HOST_NOT_OPENING);
		return -1;
	}
	if (hv)
		hflow_drop(c, hk, hv);
	/* Flows others open come from the sandbox's budget for them: a local
	 * user's flood through a mapping on lo never takes the room its own
	 * flows to the resolver need. */
	__u32 in = admission || kind == DP_HF_LO;
	if (share_take(tap_ifindex, in)) {
		count(DP_C_HOST_SHARE);
		sb_count_fam(tap_ifindex, DP_S_NO_PORT, hk->family);
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_NO_PORT, DP_FD_HOST, DP_FV_FROM_NODE), guest_port);
		return -1;
	}
	int syn = l4->proto == IPPROTO_TCP && (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	if (hflow_alloc(c, hk, sandbox_ip, guest_port, gen, syn, gw_port)) {
		share_give(tap_ifindex, in);
		count(DP_C_NO_GW_PORT);
		sb_count_fam(tap_ifindex, DP_S_NO_PORT, hk->family);
		flow_note(skb, tap_ifindex,
			  fe_what(DP_FE_REFUSED, DP_FR_NO_PORT, DP_FD_HOST, DP_FV_FROM_NODE), guest_port);
		return -1;
	}
	struct dp_hflow_val nv = {
		.last_seen_ns = bpf_ktime_get_ns(),
		.gen = gen,
		.sandbox_ip = sandbox_ip,
		.guest_port = guest_port,
		.gw_port = *gw_port,
		.kind = kind,
		.state = tcp_state(DP_TCP_OPEN, l4, DIR_IN),
		.flags = (admission ? DP_HFF_HOST_OPENED : 0) |
			 (hk->family == DP_HFAM_IPV6 && guest_fixed6(tap_ifindex) ? DP_HFF_GUEST_FIXED
										 : 0),
	};
	if (bpf_map_update_elem(&hflow, hk, &nv, BPF_NOEXIST)) {
		/* Another CPU made it first (its guest-side entry is this one's
		 * too: kept), or the map is full. */
		struct dp_hrev_key rk = {
			.sandbox_ip = sandbox_ip,
			.guest_port = guest_port,
			.gw_port = *gw_port,
			.proto = hk->proto,
			.family = hk->family,
		};
		struct dp_hrev_val *rv = bpf_map_lookup_elem(&hrev, &rk);
		struct dp_hflow_val *won = bpf_map_lookup_elem(&hflow, hk);
		if (rv && hkey_eq(&rv->host, hk) &&
		    !(won && won->sandbox_ip == sandbox_ip && won->guest_port == guest_port &&
		      won->gw_port == *gw_port))
			bpf_map_delete_elem(&hrev, &rk);
		share_give(tap_ifindex, in);
		count(DP_C_NO_GW_PORT);
		return -1;
	}
	sb_count_fam(tap_ifindex, DP_S_NEW_HOST, hk->family);
	return 0;
}

/* Into the gateway device's ingress, as a packet from the sandbox side of
 * its link: the node's stack takes it from there. */
static __always_inline int into_gwdev(struct __sk_buff *skb, const struct dp_config *c)
{
	if (set_macs(skb, c->gwdev_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_HOST);
	return bpf_redirect(c->gwdev_ifindex, BPF_F_INGRESS);
}

/* A packet from one of the agent's sockets sandboxes reach (the
 * resolver's port 53, the proxy's ports). */
static __always_inline int agent_service_port(const struct l4info *l4)
{
	return l4->sport == bpf_htons(53) || l4->sport == bpf_htons(DP_PROXY_TLS_PORT) ||
	       l4->sport == bpf_htons(DP_PROXY_HTTP_PORT);
}

/* A guest's TCP to the proxy's ports: only guest_to_proxy sends there. */
static __always_inline int to_proxy_port(const struct l4info *l4)
{
	return l4->proto == IPPROTO_TCP && (l4->dport == bpf_htons(DP_PROXY_TLS_PORT) ||
					    l4->dport == bpf_htons(DP_PROXY_HTTP_PORT));
}

/* A new host flow the guest opens, `hk` (kind `kind`, DP_HFF_* `flags`,
 * the peer it dialled for DP_HF_PROXY), within the sandbox's share and
 * counted: 0, or -1 (dropped: the share is used up, or the key taken). */
static __always_inline int guest_flow_new(struct __sk_buff *skb, const struct dp_sandbox *sb,
					  const struct dp_hflow_key *hk, const struct l4info *l4,
					  __u8 kind, __u16 flags, __u32 peer_ip, const __u32 *peer6)
{
	if (share_take(skb->ifindex, 0)) {
		count(DP_C_HOST_SHARE);
		sb_count_fam(skb->ifindex, DP_S_NO_PORT, hk->family);
		return -1;
	}
	struct dp_hflow_val nv = {
		.last_seen_ns = bpf_ktime_get_ns(),
		.gen = sb->gen,
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4->sport,
		.gw_port = l4->dport,
		.kind = kind,
		.state = tcp_state(DP_TCP_OPEN, l4, DIR_OUT),
		.flags = flags,
		.peer_ip = peer_ip,
	};
	if (peer6)
		__builtin_memcpy(nv.peer6, peer6, sizeof(nv.peer6));
	if (bpf_map_update_elem(&hflow, hk, &nv, BPF_NOEXIST)) {
		share_give(skb->ifindex, 0);
		count(DP_C_NO_GW_PORT);
		return -1;
	}
	sb_count_fam(skb->ifindex, DP_S_NEW_HOST, hk->family);
	return 0;
}

/* Host <-> sandbox over IPv6 (docs/dual-stack.md "Host <-> sandbox"): the
 * sandbox's identity is pool6 ‖ sandbox_ip, the gateway device's pool6 ‖
 * host_ip; a host flow is the IPv4 one those words name, of family
 * DP_HFAM_IPV6 (hflow, hrev, shares and the reaper are IPv4's). */
static __always_inline int pool6_on(const struct dp_config *c)
{
	return c->pool6[0] | c->pool6[1] | c->pool6[2];
}

static __always_inline void pool6_addr(__u32 *a, const struct dp_config *c, __u32 v4)
{
	a[0] = c->pool6[0];
	a[1] = c->pool6[1];
	a[2] = c->pool6[2];
	a[3] = v4;
}
