// SPDX-License-Identifier: GPL-2.0
/* cube-network-agent datapath: tc (clsact, direct-action) programs.
 *
 *  from_guest     ingress of every sandbox TAP: anti-spoofing, proxy ARP,
 *                 guest -> gateway (host), guest -> world (policy + SNAT,
 *                 or the reply side of a port mapping).
 *  from_uplink    ingress of the node uplink: SNAT replies and port-mapped
 *                 connections are rewritten to the guest and redirected
 *                 to its TAP; everything else goes on to the host stack.
 *                 The host wins: a packet a host socket would receive
 *                 (a listener or bound socket for a new mapped flow, an
 *                 established socket for a SNAT reply) goes to the host.
 *  to_sandbox_ip  egress of the gateway device (cube-dev): host -> sandbox
 *                 IP is rewritten to the guest address (source: the
 *                 gateway) and redirected to the TAP.
 *  from_host      egress of lo: the host's own connections to a mapped
 *                 host port (127.x or the uplink address for a wildcard
 *                 mapping, the mapping's own address otherwise) are
 *                 rewritten to the guest (source: the gateway) and
 *                 redirected to its TAP, unless a host socket listens
 *                 there; replies go back into lo.
 *  to_uplink      egress of the uplink: a host connection whose tuple a
 *                 live sandbox SNAT flow holds leaves with another source
 *                 port (and its replies get theirs back), so neither side
 *                 ever receives the other's packets.
 *
 * Every host <-> sandbox flow (host -> sandbox IP, host -> mapped port via
 * lo, guest -> gateway) has a tuple of its own on the guest's side
 * (hflow/hrev): the host's source port when free there, another one else.
 *
 * State lives in maps pinned by name, keyed by things that survive an agent
 * restart: TAP ifindex (a persistent TAP keeps it), sandbox IP, ports.
 * Headers are read with bpf_skb_load_bytes and rewritten with the
 * store/csum helpers, which also handle CHECKSUM_PARTIAL and GSO packets
 * from VMMs that enable TAP offloads.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "datapath.h"

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif
/* From linux/if_arp.h and linux/icmp.h, which drag in libc headers. */
#define ICMP_ECHOREPLY 0
#define ICMP_ECHO 8
struct icmphdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be16 id;
	__be16 sequence;
};
#define ARPHRD_ETHER 1
#define ARPOP_REQUEST 1
#define ARPOP_REPLY 2
struct arphdr {
	__be16 ar_hrd;
	__be16 ar_pro;
	__u8 ar_hln;
	__u8 ar_pln;
	__be16 ar_op;
};
#define IP_CSUM_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, check))
#define IP_SRC_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, saddr))
#define IP_DST_OFF (ETH_HLEN + __builtin_offsetof(struct iphdr, daddr))
#define LOOPBACK_IFINDEX 1 /* lo is ifindex 1 in every network namespace */
#define IP_MF 0x2000
#define TCP_FIN 1
#define TCP_SYN 2
#define TCP_RST 4
#define TCP_ACK 8
#define IP_OFFSET 0x1fff

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct dp_config);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, DP_C_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

/* Per-sandbox counters, keyed by TAP/veth ifindex; the agent creates an
 * entry when it attaches a sandbox and removes it with the device. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_sb_stats);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sb_stats SEC(".maps");

/* Per sandbox (TAP or veth ifindex): its IPv6 frames both ways (the part
 * of its device's counters that is IPv6), per CPU, so that the packets
 * that pay for them never share a cache line. The agent makes an entry
 * with the sandbox's sb_stats entry; the reaper removes it with the
 * device. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, __u32);
	__type(value, struct dp_traffic6);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sb_traffic6 SEC(".maps");

/* The uplink's shaper classes of a sandbox with an egress limit, keyed by
 * TAP/veth ifindex (DP_F_SHAPE_OUT says to look), written by the agent at
 * attach, removed with the network. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_rate);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sb_rate SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_sandbox);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sandboxes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_tap);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} by_ip SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct dp_policy_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy_allow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct dp_policy_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy_deny SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct dp_policy6_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy6_allow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct dp_policy6_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy6_deny SEC(".maps");

/* Not an LRU: the kernel would evict entries that started flows depend
 * on, of any sandbox. The agent bounds it (a per-sandbox cap, release,
 * converge); entries take memory only once written. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_learned_key);
	__type(value, struct dp_learned_val);
	__uint(max_entries, DP_LEARNED_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dns_learned SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_learned6_key);
	__type(value, struct dp_learned_val);
	__uint(max_entries, DP_LEARNED_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dns_learned6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_portmap_key);
	__type(value, struct dp_portmap_val);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} portmap SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_ct_key);
	__type(value, struct dp_ct_val);
	__uint(max_entries, 262144);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_rev_key);
	__type(value, struct dp_rev_val);
	__uint(max_entries, 262144);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ct_rev SEC(".maps");

/* NAT66 flows: the IPv6 twins of ct and ct_rev (same sizes). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_ct6_key);
	__type(value, struct dp_ct_val);
	__uint(max_entries, 262144);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ct6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_rev6_key);
	__type(value, struct dp_rev_val);
	__uint(max_entries, 262144);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ct_rev6 SEC(".maps");

/* Programs reached by tail call (each with a 512-byte stack of its own):
 * the IPv6 world paths. Pinned, so that the entries outlive the agent
 * (a program array is emptied when its last user reference goes). */
#define TAIL_GUEST6_OUT 0
#define TAIL_UPLINK6_IN 1
#define TAIL_GUEST6_RST 2
#define TAIL_ICMP6_ERROR 3
#define TAIL_GUEST6_STEER 4
#define TAIL_UPLINK6_FRAG 5
#define TAIL_HOST_TO_SANDBOX6 6
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
	__uint(max_entries, 7);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} tails SEC(".maps");

/* Host connections in the SNAT range: (remote, remote port, the host's
 * own port) -> the port it leaves with (identity unless a sandbox flow
 * held that tuple first), timestamps and TCP state. The same tuple space
 * as SNAT: ct_rev holds (remote, remote port, port it leaves with) ->
 * sandbox_ip 0, guest_port = the host's own port. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_rev_key);
	__type(value, struct dp_ct_val);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_nat SEC(".maps");

/* Host <-> sandbox flows. Not LRUs: nothing is evicted behind a flow's
 * back; every sandbox's entries are bounded by its share (sb_share,
 * share_take) and the reaper removes expired ones. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_hflow_key);
	__type(value, struct dp_hflow_val);
	__uint(max_entries, DP_HFLOW_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hflow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_hrev_key);
	__type(value, struct dp_hrev_val);
	__uint(max_entries, DP_HFLOW_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hrev SEC(".maps");

/* Per sandbox (TAP or veth ifindex): entries it holds in the shared
 * tables; created with its sb_stats entry, removed with its device. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_share);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sb_share SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct dp_share_pool);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} share_pool SEC(".maps");

/* uids whose processes may open flows to sandbox addresses (besides root):
 * the agent writes it from its configuration at every start. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u8);
	__uint(max_entries, 256);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_access SEC(".maps");

/* An IPv6 address as a global function's argument (a sized type). */
struct dp_in6 {
	__u32 w[4];
};

/* The node's own addresses, every device's (the agent follows them:
 * written at every start before the programs run, then on each address
 * notification): a sandbox's packet to one never leaves by the uplink. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u8);
	__uint(max_entries, DP_NODE_ADDRS_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} node_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dp_in6);
	__type(value, __u8);
	__uint(max_entries, DP_NODE_ADDRS_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} node_addrs6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_frag_key);
	__type(value, struct dp_frag_val);
	__uint(max_entries, 8192);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} frags SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dp_frag6_key);
	__type(value, struct dp_frag6_val);
	__uint(max_entries, 8192);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} frags6 SEC(".maps");

/* Bookkeeping for the agent: TAP ifindex -> 1 once the from_guest filter
 * is attached (filters outlive the agent, so a restart skips them). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} tap_attached SEC(".maps");

/* Paused sandboxes: the first packet of each pause (TAP/veth ifindex ->
 * what it was), and the ring that tells the agent. Pinned: what the ring
 * holds when the agent stops is read by the next one. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dp_wake);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} wake_sent SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, DP_WAKES_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} wakes SEC(".maps");

struct l4info {
	__u32 off;      /* offset of the L4 header */
	__u32 csum_off; /* offset of its checksum */
	__u16 sport;    /* TCP/UDP ports; ICMP echo id in both */
	__u16 dport;
	__u8 proto;
	__u8 icmp_type;
	__u8 tcp_flags; /* TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK below */
	__u8 frag;      /* 1 = a fragment after the first (no L4 header) */
	__u8 first_frag; /* 1 = the first fragment of several (L4 header parsed) */
	__u8 tcp_doff;  /* TCP header length in 32-bit words */
	__u32 tcp_seq;  /* host order */
	__u32 tcp_end;  /* host order: the sequence number after this segment */
};

/* Which way a packet goes relative to the flow's sandbox (or, for
 * host_nat, the host). */
#define DIR_OUT 0
#define DIR_IN 1
/* How long a fragment's first sibling is remembered (ipfrag_time). */
#define FRAG_TTL_NS (30ULL * 1000000000ULL)

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	if (v)
		*v += 1;
}

/* One of a sandbox's own counters (see enum dp_sb_counter): a lookup and
 * an atomic add, on drop and new-flow paths only. */
static __always_inline void sb_count(__u32 ifindex, __u32 which)
{
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (s && which < DP_S_MAX)
		__sync_fetch_and_add(&s->c[which], 1);
}

/* sb_count for an IPv6 packet: the total and the IPv6 part. */
static __always_inline void sb_count6(__u32 ifindex, __u32 which)
{
	struct dp_sb_stats *s = bpf_map_lookup_elem(&sb_stats, &ifindex);
	if (s && which < DP_S_MAX) {
		__sync_fetch_and_add(&s->c[which], 1);
		__sync_fetch_and_add(&s->v6[which], 1);
	}
}

/* sb_count or sb_count6 by a host flow's family (DP_HFAM_*). */
static __always_inline void sb_count_fam(__u32 ifindex, __u32 which, __u8 family)
{
	if (family == 6)
		sb_count6(ifindex, which);
	else
		sb_count(ifindex, which);
}

/* One IPv6 frame of `len` bytes the sandbox on `ifindex` sent (`rx` 0) or
 * is sent (`rx` 1): sb_traffic6 (whose entry the agent made with the
 * sandbox's sb_stats entry). A global function: its frame is its own. */
__noinline int traffic6(__u32 ifindex, __u32 rx, __u32 len)
{
	struct dp_traffic6 *t = bpf_map_lookup_elem(&sb_traffic6, &ifindex);
	if (!t)
		return 0;
	if (rx) {
		t->rx_bytes += len;
		t->rx_packets += 1;
	} else {
		t->tx_bytes += len;
		t->tx_packets += 1;
	}
	return 0;
}

/* An IPv6 frame to the sandbox on `ifindex`, counted. */
static __always_inline int to_guest6(struct __sk_buff *skb, __u32 ifindex)
{
	traffic6(ifindex, 1, skb->len);
	return bpf_redirect(ifindex, 0);
}

/* The upgrade test (tests/upgrade/build-next.sh) builds a second datapath
 * that differs only here (1): every program gets another tag and behaves
 * the same. */
#define DP_BUILD_SALT 0

static __always_inline struct dp_config *get_config(void)
{
	__u32 zero = 0;
	asm volatile("" : : "r"(DP_BUILD_SALT));
	return bpf_map_lookup_elem(&config, &zero);
}

/* Whether `a` is a sandbox identity or on the guests' link: the pool (but
 * the gateway device's own address) or 169.254.68.4/30. Such a source
 * enters the node through the datapath only. */
static __always_inline int sandbox_source(const struct dp_config *c, __u32 a)
{
	if (a == c->host_ip)
		return 0;
	if (c->pool_mask && (a & c->pool_mask) == (c->host_ip & c->pool_mask))
		return 1;
	return (a & bpf_htonl(0xfffffffc)) == (c->gateway_ip & bpf_htonl(0xfffffffc));
}

/* Whether a sandbox's packet to `a` is for the node itself: loopback, an
 * address of the node's (node_addrs), or the pool (another sandbox's, or
 * the gateway device's). */
static __always_inline int node_dst(const struct dp_config *c, __u32 a)
{
	if ((a & 0xff) == 127 || a == c->uplink_ip)
		return 1;
	if (c->pool_mask && (a & c->pool_mask) == (c->host_ip & c->pool_mask))
		return 1;
	return bpf_map_lookup_elem(&node_addrs, &a) != NULL;
}

/* The same for IPv6 sources: an ipv6_pool identity (but the gateway
 * device's own address) or the guests' link fd63:7562:6500::/64. A global
 * function: its own frame. */
__noinline int sandbox_source6(const struct dp_in6 *a)
{
	struct dp_config *c = get_config();
	if (!c || !a)
		return 0;
	if (a->w[0] == bpf_htonl(DP_V6_PREFIX0) && a->w[1] == bpf_htonl(DP_V6_PREFIX1))
		return 1;
	if (!(c->pool6[0] | c->pool6[1] | c->pool6[2]))
		return 0;
	return a->w[0] == c->pool6[0] && a->w[1] == c->pool6[1] && a->w[2] == c->pool6[2] &&
	       a->w[3] != c->host_ip;
}

/* Whether an IPv6 packet arriving from outside the datapath (the uplink,
 * a node process through lo) has a sandbox identity or the guests' link as
 * its source: forged (counted). */
static __always_inline int forged6(struct __sk_buff *skb)
{
	struct dp_in6 src;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8 /* ipv6hdr.saddr */, &src,
			       sizeof(src)) ||
	    !sandbox_source6(&src))
		return 0;
	count(DP_C_FORGED_SOURCE);
	return 1;
}

/* Whether a sandbox's IPv6 packet to `a` is for the node itself: ::1, an
 * address of the node's (node_addrs6), an ipv6_pool identity. */
__noinline int node_dst6(const struct dp_in6 *a)
{
	struct dp_config *c = get_config();
	if (!c || !a)
		return 0;
	if (!a->w[0] && !a->w[1] && !a->w[2] && a->w[3] == bpf_htonl(1))
		return 1;
	if ((c->pool6[0] | c->pool6[1] | c->pool6[2]) && a->w[0] == c->pool6[0] &&
	    a->w[1] == c->pool6[1] && a->w[2] == c->pool6[2])
		return 1;
	struct dp_in6 k = *a;
	return bpf_map_lookup_elem(&node_addrs6, &k) != NULL;
}

/* The guest on `ifindex` uses its static fd63:7562:6500::6 (sb_share.
 * guest6, learn_guest6), not its SLAAC address. */
static __always_inline int guest_fixed6(__u32 ifindex)
{
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	return s && s->guest6 == DP_SHARE_FIXED6;
}

/* The ct6 entry under `key` of a mapped flow to the guest on `ifindex`
 * (owner generation `gen`), whatever its guest address: the guest's
 * current one (guest_fixed6) first, else the other one if a live mapped
 * flow of this owner has it (a guest with both addresses may have changed
 * its current one since the flow started: the flow keeps its own).
 * `key->gaddr` is left as the entry's, or the current one (a new flow's). */
static __always_inline struct dp_ct_val *ct6_to_guest(struct dp_ct6_key *key, __u32 ifindex,
						      __u64 gen)
{
	key->gaddr = guest_fixed6(ifindex) ? DP_GADDR_FIXED : DP_GADDR_SLAAC;
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, key);
	if (v)
		return v;
	key->gaddr ^= 1; /* DP_GADDR_FIXED <-> DP_GADDR_SLAAC */
	v = bpf_map_lookup_elem(&ct6, key);
	if (v && v->gen == gen && v->kind == DP_CT_PORTMAP)
		return v;
	key->gaddr ^= 1;
	return NULL;
}

/* Takes one host-flow entry of the sandbox on `ifindex`'s share: one of
 * its guaranteed ones, else one of the shared pool up to its cap. 0 or -1
 * (nothing taken). A device without an sb_share entry (bound by a build
 * before shares) is not limited. The check and the count are two steps
 * (the instruction set this object targets has no fetching atomics), so
 * CPUs racing for the last entries may each take one: a share can be
 * exceeded by at most the number of CPUs. Global functions (these three):
 * the verifier checks each once, not along every path that calls it. */
/* One budget of a sandbox's share (dp_share): `in` (flows others opened)
 * or the guest's own; its guaranteed entries and its cap. */
static __always_inline __u32 budget_guaranteed(const struct dp_config *c, __u32 in)
{
	__u32 own = (c->hflow_guaranteed + 1) / 2;
	return in ? c->hflow_guaranteed - own : own;
}

static __always_inline __u32 budget_cap(const struct dp_config *c)
{
	__u32 cap = c->hflow_cap / 2;
	return cap ? cap : 1;
}

/* Takes an entry of the sandbox's budget `in` (1: a flow someone else
 * opened to it; 0: one the guest opened): 0, or -1 when it is used up. */
__noinline int share_take(__u32 ifindex, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (!s || !c)
		return 0;
	__u32 v = s->hflow;
	__u32 held = in ? v >> 16 : v & 0xffff;
	if (held >= budget_cap(c))
		return -1;
	if (held >= budget_guaranteed(c, in)) {
		__u32 zero = 0;
		struct dp_share_pool *p = bpf_map_lookup_elem(&share_pool, &zero);
		if (!p)
			return -1;
		__u32 all = p->hflow_borrowed, others = p->hflow_borrowed_in;
		__u32 mine = in ? others : all - others;
		if (all >= c->hflow_borrow || mine >= c->hflow_borrow / 2)
			return -1;
		__sync_fetch_and_add(&p->hflow_borrowed, 1);
		if (in)
			__sync_fetch_and_add(&p->hflow_borrowed_in, 1);
	}
	__sync_fetch_and_add(&s->hflow, in ? 0x10000 : 1);
	return 0;
}

/* Gives one of `s`'s budget `in` back. */
static __always_inline void give(const struct dp_config *c, struct dp_share *s, __u32 in)
{
	__u32 v = s->hflow;
	__u32 held = in ? v >> 16 : v & 0xffff;
	if (held == 0)
		return; /* never below zero (the reaper's recount may have raced) */
	__sync_fetch_and_add(&s->hflow, in ? -0x10000 : -1);
	if (held > budget_guaranteed(c, in)) {
		__u32 zero = 0;
		struct dp_share_pool *p = bpf_map_lookup_elem(&share_pool, &zero);
		if (p && p->hflow_borrowed > 0)
			__sync_fetch_and_add(&p->hflow_borrowed, -1);
		if (p && in && p->hflow_borrowed_in > 0)
			__sync_fetch_and_add(&p->hflow_borrowed_in, -1);
	}
}

/* Gives one back (an entry share_take counted was removed). */
__noinline int share_give(__u32 ifindex, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s && c)
		give(c, s, in);
	return 0;
}

/* A host flow of the sandbox at `sandbox_ip`, opened by its owner of
 * generation `gen`, was removed: the owner (if it still owns the address)
 * gets the entry's share back. */
__noinline int hflow_gone(__u32 sandbox_ip, __u64 gen, __u32 in)
{
	struct dp_config *c = get_config();
	struct dp_tap *t = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!c || !t || t->gen != gen)
		return 0;
	__u32 ifindex = t->ifindex;
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s)
		give(c, s, in);
	return 0;
}

/* Which budget of its sandbox's share a host flow counts against: 1 for
 * one the node (or a local process through a mapping) opened. */
static __always_inline __u32 hflow_budget(const struct dp_hflow_val *v)
{
	return (v->flags & DP_HFF_HOST_OPENED) || v->kind == DP_HF_LO;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] &&
	       a[4] == b[4] && a[5] == b[5];
}

/* Reads the IPv4 header and what NAT needs of L4. <0: malformed. */
/* The TCP or UDP header at l4->off (l4->proto says which): ports, the
 * checksum's offset, and TCP's flags and sequence numbers (`len`: the
 * bytes from the L4 header on, for the sequence after the segment). */
static __always_inline int parse_ports(struct __sk_buff *skb, struct l4info *l4, __u32 len)
{
	if (l4->proto == IPPROTO_TCP) {
		struct tcphdr th;
		if (bpf_skb_load_bytes(skb, l4->off, &th, sizeof(th)))
			return -1;
		l4->sport = th.source;
		l4->dport = th.dest;
		l4->csum_off = l4->off + __builtin_offsetof(struct tcphdr, check);
		l4->tcp_flags = (th.fin ? TCP_FIN : 0) | (th.rst ? TCP_RST : 0) |
				(th.syn ? TCP_SYN : 0) | (th.ack ? TCP_ACK : 0);
		l4->tcp_doff = th.doff;
		l4->tcp_seq = bpf_ntohl(th.seq);
		__u32 hdr = th.doff * 4;
		l4->tcp_end = l4->tcp_seq + (len > hdr ? len - hdr : 0) + th.fin + th.syn;
		return 0;
	}
	struct udphdr uh;
	if (bpf_skb_load_bytes(skb, l4->off, &uh, sizeof(uh)))
		return -1;
	l4->sport = uh.source;
	l4->dport = uh.dest;
	l4->csum_off = l4->off + __builtin_offsetof(struct udphdr, check);
	return 0;
}

static __always_inline int parse_ipv4(struct __sk_buff *skb, struct iphdr *ip,
				      struct l4info *l4)
{
	if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(*ip)))
		return -1;
	if (ip->version != 4 || ip->ihl < 5)
		return -1;
	__builtin_memset(l4, 0, sizeof(*l4));
	l4->proto = ip->protocol;
	l4->off = ETH_HLEN + ip->ihl * 4;
	if (ip->frag_off & bpf_htons(IP_OFFSET)) {
		l4->frag = 1;
		return 0;
	}
	if (ip->frag_off & bpf_htons(IP_MF))
		l4->first_frag = 1;
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		__u32 tot = bpf_ntohs(ip->tot_len), hl = ip->ihl * 4;
		return parse_ports(skb, l4, tot > hl ? tot - hl : 0);
	} else if (ip->protocol == IPPROTO_ICMP) {
		struct icmphdr ih;
		if (bpf_skb_load_bytes(skb, l4->off, &ih, sizeof(ih)))
			return -1;
		l4->icmp_type = ih.type;
		l4->sport = ih.id;
		l4->dport = ih.id;
		l4->csum_off = l4->off + __builtin_offsetof(struct icmphdr, checksum);
	}
	return 0;
}

static __always_inline __u64 l4_csum_flags(const struct l4info *l4)
{
	return l4->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* Replaces an IPv4 address (at `off`), fixing the IP checksum and the
 * TCP/UDP pseudo-header checksum. */
static __always_inline int set_addr(struct __sk_buff *skb, __u32 off, __u32 old,
				    __u32 new, const struct l4info *l4)
{
	if (old == new)
		return 0;
	if (!l4->frag && (l4->proto == IPPROTO_TCP || l4->proto == IPPROTO_UDP)) {
		if (bpf_l4_csum_replace(skb, l4->csum_off, old, new,
					BPF_F_PSEUDO_HDR | sizeof(new) | l4_csum_flags(l4)))
			return -1;
	}
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* Replaces a port (or ICMP echo id) at `off`, fixing the L4 checksum. */
static __always_inline int set_port(struct __sk_buff *skb, __u32 off, __u16 old,
				    __u16 new, const struct l4info *l4)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4->csum_off, old, new,
				sizeof(new) | l4_csum_flags(l4)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline __u32 src_port_off(const struct l4info *l4)
{
	/* TCP and UDP source ports are the first field; the ICMP echo id is at 4. */
	return l4->proto == IPPROTO_ICMP ? l4->off + 4 : l4->off;
}

static __always_inline __u32 dst_port_off(const struct l4info *l4)
{
	return l4->proto == IPPROTO_ICMP ? l4->off + 4 : l4->off + 2;
}

static __always_inline int set_macs(struct __sk_buff *skb, const __u8 *dst, const __u8 *src)
{
	__u8 macs[12];
	__builtin_memcpy(macs, dst, 6);
	__builtin_memcpy(macs + 6, src, 6);
	return bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0);
}

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

static __always_inline void touch(struct dp_ct_val *v, const struct l4info *l4, int dir)
{
	v->last_seen_ns = bpf_ktime_get_ns();
	v->state = tcp_state(v->state, l4, dir);
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

/* Whether a socket of the host would receive a packet with this tuple
 * (saddr:sport -> daddr:dport, as it arrives): TCP established, request
 * and TIME-WAIT sockets, and listeners when `listeners` is set; any bound
 * UDP socket (connected or not). ICMP has no sockets here. */
static __always_inline int host_socket(struct __sk_buff *skb, __u8 proto, __u32 saddr,
				       __u16 sport, __u32 daddr, __u16 dport, int listeners)
{
	struct bpf_sock_tuple t = {};
	t.ipv4.saddr = saddr;
	t.ipv4.daddr = daddr;
	t.ipv4.sport = sport;
	t.ipv4.dport = dport;
	/* Two separate paths: the verifier refuses one load instruction for
	 * both a sock_common (skc lookup) and a sock pointer. */
	if (proto == IPPROTO_TCP) {
		struct bpf_sock *sk =
			bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		int owned = listeners || sk->state != BPF_TCP_LISTEN;
		bpf_sk_release(sk);
		return owned;
	}
	if (proto == IPPROTO_UDP) {
		struct bpf_sock *sk =
			bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	return 0;
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

/* The IPv4 port mapping for a packet to daddr:dport: the mapping on
 * exactly that address first, then (if `wildcard`) the one on every node
 * address, unless that one is IPv6's only (DP_PM_V6_ONLY). */
static __always_inline struct dp_portmap_val *find_portmap(__u32 daddr, __u16 dport, __u8 proto,
							   int wildcard)
{
	struct dp_portmap_key pk = {.host_ip = daddr, .host_port = dport, .proto = proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (pm || !wildcard)
		return pm;
	pk.host_ip = 0;
	pm = bpf_map_lookup_elem(&portmap, &pk);
	return pm && !(pm->flags & DP_PM_V6_ONLY) ? pm : NULL;
}

/* A packet that would open a new flow: no flow entry yet, or a TCP SYN. */
static __always_inline int opens_flow(const struct dp_ct_val *v, const struct l4info *l4)
{
	return !v || (l4->proto == IPPROTO_TCP &&
		      (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN);
}

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
		return -1;
	}
	int syn = l4->proto == IPPROTO_TCP && (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	if (hflow_alloc(c, hk, sandbox_ip, guest_port, gen, syn, gw_port)) {
		share_give(tap_ifindex, in);
		count(DP_C_NO_GW_PORT);
		sb_count_fam(tap_ifindex, DP_S_NO_PORT, hk->family);
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

/* The host flow of a guest's TCP or UDP packet to its gateway (address
 * family `family`, DP_HFAM_*): the reply side of a flow the host opened
 * (its hrev entry), else a flow the guest opens to the node, made here
 * (the node sees sandbox address -> gateway-device address, the guest's
 * ports kept). Its key in `hk` and kind in `kind`; -1: dropped. */
static __always_inline int guest_host_flow(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb, const struct l4info *l4,
					   __u8 family, __u16 flags, struct dp_hflow_key *hk,
					   __u8 *kind)
{
	struct dp_hrev_key rk = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4->sport,
		.gw_port = l4->dport,
		.proto = l4->proto,
		.family = family,
	};
	struct dp_hflow_val *hv = NULL;
	struct dp_hrev_val *rv = bpf_map_lookup_elem(&hrev, &rk);
	if (rv && rv->gen == sb->gen) {
		*hk = rv->host;
		hv = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
		if (hv && (hv->guest_port != l4->sport || hv->gw_port != l4->dport))
			hv = NULL;
	}
	if (hv) {
		hv->last_seen_ns = bpf_ktime_get_ns();
		hv->state = tcp_state(hv->state, l4, DIR_OUT);
		*kind = hv->kind;
		return 0;
	}
	if (rv)
		bpf_map_delete_elem(&hrev, &rk);
	/* A TCP segment other than a SYN of a flow nobody has (one the host
	 * opened, whose entries are gone) is not a flow the guest opens:
	 * made one, the host would answer it with a reset, or another socket
	 * of the host would get it. */
	if (l4->proto == IPPROTO_TCP && (l4->tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		count(DP_C_NO_HOST_FLOW);
		return -1;
	}
	/* A flow the guest opens: the host sees sandbox address -> gateway-
	 * device address, ports as the guest chose them. */
	hk->saddr = c->host_ip;
	hk->daddr = sb->sandbox_ip;
	hk->sport = l4->dport;
	hk->dport = l4->sport;
	hk->proto = l4->proto;
	hk->family = family;
	hk->pad[0] = hk->pad[1] = 0;
	struct dp_hflow_val *other = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
	if (other) {
		/* The host's tuple is another flow's (a host connection mapped
		 * to this guest port): taken over only by a SYN when that one
		 * is closed. */
		if (!(l4->proto == IPPROTO_TCP && tcp_closed(other->state))) {
			count(DP_C_NO_GW_PORT);
			sb_count_fam(skb->ifindex, DP_S_NO_PORT, family);
			return -1;
		}
		hflow_drop(c, hk, other);
	}
	if (guest_flow_new(skb, sb, hk, l4, DP_HF_GWDEV, flags, 0, NULL))
		return -1;
	struct dp_hrev_val nrv = {.host = *hk, .gen = sb->gen};
	bpf_map_update_elem(&hrev, &rk, &nrv, BPF_ANY);
	*kind = DP_HF_GWDEV;
	return 0;
}

/* guest -> 169.254.68.5. A reply of a host flow goes back exactly where
 * that flow came from (the sandbox IP via the gateway device, or a mapped
 * address via lo); anything else is a flow the guest opens to the host,
 * delivered as sandbox IP -> gateway-device IP with its ports kept. */
static __always_inline int guest_to_host(struct __sk_buff *skb, const struct dp_config *c,
					 const struct dp_sandbox *sb, const struct iphdr *ip,
					 const struct l4info *l4)
{
	__u8 kind = DP_HF_GWDEV;
	if (!l4->frag && !l4->first_frag &&
	    (l4->proto == IPPROTO_TCP || l4->proto == IPPROTO_UDP)) {
		struct dp_hflow_key hk;
		if (guest_host_flow(skb, c, sb, l4, DP_HFAM_IPV4, 0, &hk, &kind))
			return TC_ACT_SHOT;
		/* The host's tuple, reversed. */
		if (set_addr(skb, IP_SRC_OFF, ip->saddr, hk.daddr, l4) ||
		    set_addr(skb, IP_DST_OFF, ip->daddr, hk.saddr, l4) ||
		    set_port(skb, src_port_off(l4), l4->sport, hk.dport, l4) ||
		    set_port(skb, dst_port_off(l4), l4->dport, hk.sport, l4))
			return TC_ACT_SHOT;
	} else if (set_addr(skb, IP_SRC_OFF, ip->saddr, sb->sandbox_ip, l4) ||
		   set_addr(skb, IP_DST_OFF, ip->daddr, c->host_ip, l4)) {
		return TC_ACT_SHOT;
	}
	if (kind == DP_HF_LO) {
		__u8 zero[6] = {};
		if (set_macs(skb, zero, zero))
			return TC_ACT_SHOT;
		count(DP_C_LOCAL);
		return bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS);
	}
	return into_gwdev(skb, c);
}

/* guest_to_host as a global function: the verifier checks it once, and
 * from_guest's stack does not carry its locals (the call chain from_guest
 * -> steer_to_agent -> share_take must fit 512 bytes). */
__noinline int guest_to_gateway(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct iphdr ip;
	struct l4info l4;
	if (!sb || parse_ipv4(skb, &ip, &l4))
		return TC_ACT_SHOT;
	return guest_to_host(skb, c, sb, &ip, &l4);
}

/* The first fragment of a datagram that goes to a sandbox: the fragments
 * after it (no ports) follow it there, with the same addresses. */
static __always_inline void frag_note(const struct iphdr *ip, __u32 ifindex, __u64 gen,
				      __u32 new_saddr, __u32 new_daddr)
{
	struct dp_frag_key fk = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.id = ip->id,
		.proto = ip->protocol,
	};
	struct dp_frag_val fv = {
		.first_seen_ns = bpf_ktime_get_ns(),
		.gen = gen,
		.ifindex = ifindex,
		.new_saddr = new_saddr,
		.new_daddr = new_daddr,
	};
	bpf_map_update_elem(&frags, &fk, &fv, BPF_ANY);
}

/* A fragment after the first: where its first sibling went (still the same
 * sandbox's TAP), else -1 (the host's own, or its first sibling has not
 * arrived: the host's reassembly times out without an ICMP error). */
static __always_inline int frag_follow(struct __sk_buff *skb, const struct dp_config *c,
				       const struct iphdr *ip, const struct l4info *l4)
{
	struct dp_frag_key fk = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.id = ip->id,
		.proto = ip->protocol,
	};
	struct dp_frag_val *fv = bpf_map_lookup_elem(&frags, &fk);
	if (!fv || bpf_ktime_get_ns() - fv->first_seen_ns > FRAG_TTL_NS)
		return -1;
	__u32 ifindex = fv->ifindex;
	__u32 new_saddr = fv->new_saddr, new_daddr = fv->new_daddr;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb || sb->gen != fv->gen)
		return -1;
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, new_saddr, l4) ||
	    set_addr(skb, IP_DST_OFF, ip->daddr, new_daddr, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_FRAG);
	return bpf_redirect(ifindex, 0);
}

/* Sends a translated packet out of the uplink (FIB lookup, next hop).
 * Inlined: on every packet of every flow to the world (as a global
 * function it cost ~10 % more per packet in cube-dpbench). */
static __always_inline int forward_out(struct __sk_buff *skb, const struct dp_config *c,
				       __u32 daddr, __u32 tos, __u32 protocol)
{
	if (daddr == c->uplink_ip) {
		/* Hairpin: a flow to a mapping at the node's own address (or a
		 * reply to one) turns around into the uplink's ingress, as if
		 * the router sent it back; from_uplink knows it by the mark.
		 * guest_to_world lets no other flow to the node come here. */
		skb->mark = DP_HAIRPIN_MARK;
		count(DP_C_HAIRPIN);
		return bpf_redirect(c->uplink_ifindex, BPF_F_INGRESS);
	}
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET;
	fib.tos = tos;
	fib.l4_protocol = protocol;
	/* tot_len 0: the kernel checks the MTU with is_skb_forwardable(),
	 * which knows GSO packets (their tot_len is the whole super-packet). */
	fib.tot_len = 0;
	fib.ipv4_src = c->uplink_ip;
	fib.ipv4_dst = daddr;
	fib.ifindex = c->uplink_ifindex;
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (set_macs(skb, fib.dmac, fib.smac))
			return TC_ACT_SHOT;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		/* No neighbour entry yet: let the kernel resolve it. */
		struct bpf_redir_neigh nh = {
			.nh_family = AF_INET,
			.ipv4_nh = fib.ipv4_dst,
		};
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED) {
		/* IPv4 forwarding is off on the uplink (the agent does not
		 * change host sysctls): the kernel routes and resolves the
		 * next hop itself, out of the uplink. */
		return bpf_redirect_neigh(c->uplink_ifindex, NULL, 0, 0);
	}
	count(DP_C_NO_ROUTE);
	sb_count(skb->ifindex, DP_S_NO_ROUTE);
	return TC_ACT_SHOT;
}

/* Whether the resolver learned `dst` for this owner of the sandbox: for
 * a new flow (`fresh`) until the entry expires, for a flow that started
 * while the entry exists. */
static __always_inline int learned(const struct dp_sandbox *sb, __u32 dst, int fresh)
{
	struct dp_learned_key lk = {.sandbox_ip = sb->sandbox_ip, .dst = dst};
	struct dp_learned_val *lv = bpf_map_lookup_elem(&dns_learned, &lk);
	if (!lv || lv->gen != sb->gen)
		return 0;
	return !fresh || lv->expires_ns > bpf_ktime_get_ns();
}

/* Whether the sandbox's policy lets it send to `dst`: an allowed CIDR;
 * else a deny CIDR other than the catch-all 0.0.0.0/0 drops it (a DNS
 * answer never opens what a deny closes); else an address learned for an
 * allowed name; else no deny. `fresh`: no flow yet. */
static __always_inline int policy_allows(const struct dp_sandbox *sb, __u32 dst, int fresh)
{
	if (!(sb->flags & DP_F_INTERNET))
		return 0;
	struct dp_policy_key pk = {.prefixlen = 64, .sandbox_ip = sb->sandbox_ip, .dst = dst};
	if (bpf_map_lookup_elem(&policy_allow, &pk))
		return 1;
	__u8 *deny = bpf_map_lookup_elem(&policy_deny, &pk);
	if (deny && *deny != DP_DENY_CATCH_ALL)
		return 0;
	if ((sb->flags & DP_F_DOMAINS) && learned(sb, dst, fresh))
		return 1;
	return !deny;
}

/* DNS over TLS (853) to anyone but the gateway: a sandbox with domain
 * rules resolves through the agent only (its DNS to port 53 anywhere goes
 * to the agent's resolver: steer_to_agent). */
static __always_inline int resolver_bypass(const struct dp_sandbox *sb, const struct l4info *l4)
{
	if (!(sb->flags & DP_F_DOMAINS) || l4->proto == IPPROTO_ICMP)
		return 0;
	return l4->dport == bpf_htons(53) || l4->dport == bpf_htons(853);
}

/* The agent's proxy port for a strict-mode sandbox's TCP flow to 80/443,
 * or 0 when the flow does not go to the proxy. */
static __always_inline __u16 proxy_port(const struct dp_sandbox *sb, const struct l4info *l4)
{
	if (!(sb->flags & DP_F_SNI) || l4->proto != IPPROTO_TCP)
		return 0;
	if (l4->dport == bpf_htons(443))
		return bpf_htons(DP_PROXY_TLS_PORT);
	if (l4->dport == bpf_htons(80))
		return bpf_htons(DP_PROXY_HTTP_PORT);
	return 0;
}

/* The guest's flow to remote:port goes to an agent socket instead: strict
 * mode's TCP to 80/443 (the proxy), and DNS to anyone but the gateway of
 * a sandbox with domain rules (UDP/TCP 53: the resolver). Delivered as
 * sandbox IP -> gateway-device IP:`pport`, with the guest's source port
 * (the agent's side is the hflow key; to_sandbox_ip sends the replies
 * from remote:port). A TCP tuple whose agent-side key another live flow
 * holds (the same source port to another address) is dropped; for UDP
 * the newer flow takes the key. */
/* guest_to_proxy's answer for a TCP segment of no flow: its caller
 * (from_guest's level: the stack of a third call would not fit) sends the
 * RST with stale_reset. Not a TC_ACT_* value. */
#define PROXY_STALE 0x7ffe

/* The host flow of the guest's flow to the agent socket on port `pport`
 * (address family `family`), continued or made: kind DP_HF_PROXY, keyed
 * by the agent's side (the gateway device's address and `pport`, the
 * sandbox's address and the guest's port), the peer the guest dialled in
 * `peer_ip` or, for IPv6, `peer6`; `flags` DP_HFF_*. 0, PROXY_STALE, or
 * TC_ACT_SHOT. */
static __always_inline int proxy_flow(struct __sk_buff *skb, const struct dp_config *c,
				      const struct dp_sandbox *sb, const struct l4info *l4,
				      __u16 pport, __u8 family, __u32 peer_ip, const __u32 *peer6,
				      __u16 flags)
{
	struct dp_hflow_key key = {
		.saddr = c->host_ip,
		.daddr = sb->sandbox_ip,
		.sport = pport,
		.dport = l4->sport,
		.proto = l4->proto,
		.family = family,
	};
	const struct dp_hflow_key *hk = &key;
	struct dp_hflow_val *hv = hflow_of(c, hk, sb->sandbox_ip, sb->gen);
	int syn = (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	if (hv && (hv->kind != DP_HF_PROXY || hv->peer_ip != peer_ip ||
		   hv->gw_port != l4->dport || hv->flags != flags ||
		   (peer6 && (hv->peer6[0] != peer6[0] || hv->peer6[1] != peer6[1] ||
			      hv->peer6[2] != peer6[2] || hv->peer6[3] != peer6[3])))) {
		if (l4->proto == IPPROTO_TCP && !(syn && tcp_closed(hv->state))) {
			count(DP_C_NO_GW_PORT);
			sb_count_fam(skb->ifindex, DP_S_NO_PORT, hk->family);
			return TC_ACT_SHOT;
		}
		hflow_drop(c, hk, hv);
		hv = NULL;
	}
	if (hv) {
		hv->last_seen_ns = bpf_ktime_get_ns();
		hv->state = tcp_state(hv->state, l4, DIR_OUT);
		return 0;
	}
	/* Only a SYN opens a TCP flow: a segment of one whose entry is gone
	 * (a guest restored from a snapshot, an expired flow) reaches no
	 * connection of the agent's; the guest gets the RST (docs/datapath.md
	 * "TCP segments of connections the sandbox never opened"). */
	if (l4->proto == IPPROTO_TCP && !syn)
		return PROXY_STALE;
	if (guest_flow_new(skb, sb, hk, l4, DP_HF_PROXY, flags, peer_ip, peer6))
		return TC_ACT_SHOT;
	return 0;
}

static __always_inline int guest_to_proxy(struct __sk_buff *skb, const struct dp_config *c,
					  const struct dp_sandbox *sb, const struct iphdr *ip,
					  const struct l4info *l4, __u16 pport)
{
	int r = proxy_flow(skb, c, sb, l4, pport, DP_HFAM_IPV4, ip->daddr, NULL, 0);
	if (r)
		return r;
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, sb->sandbox_ip, l4) ||
	    set_addr(skb, IP_DST_OFF, ip->daddr, c->host_ip, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, pport, l4))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}

#define STEER_PASS 0x7fff

/* The part of guest -> world for a sandbox with domain rules or strict
 * mode: DNS (UDP/TCP 53) to anyone goes to the agent's resolver; with
 * DP_F_SNI, TCP to 80/443 that no allowed CIDR covers goes to the proxy
 * and UDP to 443 is dropped; STEER_PASS for anything else (on to the
 * policy and SNAT). A global function: the verifier checks it once, not
 * on every path of from_guest that reaches it. */
__noinline int steer_to_agent(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct iphdr ip;
	struct l4info l4;
	if (!sb || parse_ipv4(skb, &ip, &l4))
		return TC_ACT_SHOT;
	if ((sb->flags & DP_F_DOMAINS) && l4.dport == bpf_htons(53) &&
	    (l4.proto == IPPROTO_UDP || l4.proto == IPPROTO_TCP))
		return guest_to_proxy(skb, c, sb, &ip, &l4, bpf_htons(53));
	/* No internet access: nothing for the proxy to dial (the policy drops). */
	if ((sb->flags & (DP_F_SNI | DP_F_INTERNET)) != (DP_F_SNI | DP_F_INTERNET))
		return STEER_PASS;
	struct dp_policy_key pk = {.prefixlen = 64, .sandbox_ip = sb->sandbox_ip, .dst = ip.daddr};
	if (bpf_map_lookup_elem(&policy_allow, &pk))
		return STEER_PASS;
	__u16 pport = proxy_port(sb, &l4);
	if (pport)
		return guest_to_proxy(skb, c, sb, &ip, &l4, pport);
	if (l4.proto == IPPROTO_UDP && l4.dport == bpf_htons(443)) {
		count(DP_C_POLICY_DROP);
		sb_count(ifindex, DP_S_POLICY);
		return TC_ACT_SHOT; /* QUIC: clients fall back to TCP */
	}
	return STEER_PASS;
}

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

/* The 16-bit one's complement sum of `n` bytes (n even) at `p`, unfolded. */
static __always_inline __u32 csum_words(const void *p, int n)
{
	const __u16 *w = p;
	__u32 s = 0;
	for (int i = 0; i < n / 2; i++)
		s += w[i];
	return s;
}

static __always_inline __u16 csum_fold32(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* Whether the frame's L4 checksum at `csum_off` is partial (a VMM's TAP
 * offload: the receiving side sums the header); <0: unreadable. Asked of
 * the kernel: a checksum update of a word outside the pseudo-header
 * changes the field only when the checksum is complete. */
static __always_inline int l4_partial(struct __sk_buff *skb, __u32 csum_off)
{
	__u16 before, after;
	if (bpf_skb_load_bytes(skb, csum_off, &before, 2) ||
	    bpf_l4_csum_replace(skb, csum_off, 0, bpf_htons(1), 2) ||
	    bpf_skb_load_bytes(skb, csum_off, &after, 2))
		return -1;
	return before == after;
}

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

/* ---- The guests' IPv6 link (docs/dual-stack.md) ------------------------
 * There is no IPv6 egress yet (NAT66 is a later slice), so the link is
 * what a router with no upstream offers: Router Solicitations get a Router
 * Advertisement with the on-link prefix for SLAAC and a router lifetime of
 * 0 (no default route: connections off the link fail at once in the
 * guest), the gateway's addresses answer Neighbour Solicitations and
 * echo, and whatever a guest still sends off its link (a static default
 * route) gets an RST or an ICMPv6 unreachable back at once, never a
 * timeout. Guests' RAs, redirects and DHCPv6 server messages are dropped
 * and counted; MLD and DAD are dropped quietly. */

#define IPPROTO_ICMPV6 58
#define ICMP6_DST_UNREACH 1
#define ICMP6_PARAM_PROB 4
#define ICMP6_ECHO_REQUEST 128
#define ICMP6_ECHO_REPLY 129
#define ND_ROUTER_SOLICIT 133
#define ND_ROUTER_ADVERT 134
#define ND_NEIGHBOR_SOLICIT 135
#define ND_NEIGHBOR_ADVERT 136
#define ND_REDIRECT 137
#ifndef IPPROTO_FRAGMENT
#define IPPROTO_FRAGMENT 44
#endif

struct ip6h {
	__be32 vtcflow;
	__be16 plen;
	__u8 nexthdr;
	__u8 hlim;
	__u32 saddr[4];
	__u32 daddr[4];
};

/* fe80::/64 or the guests' prefix, with the modified EUI-64 of `mac`. */
static __always_inline void v6_eui64(__u32 *a, __u32 hi0, __u32 hi1, const __u8 *mac)
{
	a[0] = bpf_htonl(hi0);
	a[1] = bpf_htonl(hi1);
	a[2] = bpf_htonl(((__u32)(mac[0] ^ 2) << 24) | ((__u32)mac[1] << 16) |
			 ((__u32)mac[2] << 8) | 0xff);
	a[3] = bpf_htonl(0xfe000000 | ((__u32)mac[3] << 16) | ((__u32)mac[4] << 8) | mac[5]);
}

static __always_inline void v6_fixed(__u32 *a, __u32 lo)
{
	a[0] = bpf_htonl(DP_V6_PREFIX0);
	a[1] = bpf_htonl(DP_V6_PREFIX1);
	a[2] = 0;
	a[3] = bpf_htonl(lo);
}

static __always_inline int v6_eui64_eq(const __u32 *a, __u32 hi0, __u32 hi1, const __u8 *mac)
{
	return a[0] == bpf_htonl(hi0) && a[1] == bpf_htonl(hi1) &&
	       a[2] == bpf_htonl(((__u32)(mac[0] ^ 2) << 24) | ((__u32)mac[1] << 16) |
				 ((__u32)mac[2] << 8) | 0xff) &&
	       a[3] == bpf_htonl(0xfe000000 | ((__u32)mac[3] << 16) | ((__u32)mac[4] << 8) | mac[5]);
}

static __always_inline int v6_fixed_eq(const __u32 *a, __u32 lo)
{
	return a[0] == bpf_htonl(DP_V6_PREFIX0) && a[1] == bpf_htonl(DP_V6_PREFIX1) && !a[2] &&
	       a[3] == bpf_htonl(lo);
}

static __always_inline int v6_is_guest(const __u32 *a, const __u8 *guest_mac)
{
	return v6_fixed_eq(a, DP_V6_GUEST_LO) ||
	       v6_eui64_eq(a, DP_V6_PREFIX0, DP_V6_PREFIX1, guest_mac) ||
	       v6_eui64_eq(a, 0xfe800000, 0, guest_mac);
}

static __always_inline int v6_is_gateway(const __u32 *a, const __u8 *gateway_mac)
{
	return v6_fixed_eq(a, DP_V6_GATEWAY_LO) || v6_eui64_eq(a, 0xfe800000, 0, gateway_mac);
}

/* The ICMPv6/TCP/UDP pseudo-header's sum. */
static __always_inline __u32 v6_pseudo(const struct ip6h *ip, __u32 len, __u8 proto)
{
	return csum_words(ip->saddr, 32) + bpf_htons(len) + bpf_htons(proto);
}

/* Replaces the frame with an IPv6 packet of `total` bytes, the first
 * `len` from `p` (the rest stored by the caller), and sends it back to
 * the guest. */
static __always_inline int v6_answer(struct __sk_buff *skb, const struct dp_config *c,
				     const void *p, __u32 len, __u32 total)
{
	if (bpf_skb_change_tail(skb, ETH_HLEN + total, 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, p, len, 0) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	/* The link's own answers (NA, RA, refusals) go ahead of bulk data on
	 * a limited sandbox's device (its default class is the bulk leaf). */
	skb->priority = DP_TAP_CLASS_SMALL;
	return bpf_redirect(skb->ifindex, 0);
}

/* The RA after its IPv6 header (built in guest_ipv6's copy of the
 * guest's header, whose job is done by then: the stack is full). */
struct v6_ra {
	__u8 type, code;
	__u16 csum;
	__u8 hop_limit, flags;
	__be16 lifetime;
	__be32 reachable, retrans;
	__u8 sll_type, sll_len, sll[6];
	__u8 pi_type, pi_len, pi_prefix_len, pi_flags;
	__be32 pi_valid, pi_preferred, pi_reserved;
	__u32 pi_prefix[4];
	/* Route Information (RFC 4191) for ::/0: the default route with a
	 * lifetime of its own, infinite, so a guest keeps it with no periodic
	 * RAs (a router lifetime is at most 9000 s; Linux takes the longer). */
	__u8 ri_type, ri_len, ri_prefix_len, ri_flags;
	__be32 ri_lifetime;
	/* Recursive DNS Server (RFC 8106): the agent's resolver at the
	 * gateway's fd63:7562:6500::5, where the node reaches sandboxes over
	 * IPv6 (pool6); lifetime 0 (no server) where it does not. */
	__u8 rd_type, rd_len;
	__u16 rd_reserved;
	__be32 rd_lifetime;
	__u32 rd_addr[4];
};
struct v6_na {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__be32 flags;
	__u32 target[4];
	__u8 tll_type, tll_len, tll[6];
};
struct v6_rst {
	struct ip6h ip;
	struct tcphdr th;
};
/* Destination unreachable, up to the quote (the guest's own header and 8
 * bytes: guest_ipv6's copy of them follows). */
struct v6_unreach {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__u16 unused[2];
};
_Static_assert(sizeof(struct v6_ra) == 88, "RA layout");
_Static_assert(sizeof(struct v6_na) == 72, "NA layout");
_Static_assert(sizeof(struct v6_unreach) == 48, "unreachable layout");

/* guest_ipv6's answer for a packet to the world from a sandbox that may
 * send there (from_guest tail-calls guest6_out). */
#define V6_TO_WORLD 0x7700
/* guest_ipv6's answer for TCP, UDP or an echo reply to the gateway's
 * fd63:7562:6500::5 on a node with host <-> sandbox over IPv6: its
 * caller goes on with guest_to_host6. Not a TC_ACT_* value. */
#define V6_TO_HOST 0x7701
/* guest_ipv6's answer for DNS, HTTP or HTTPS to the world from a sandbox
 * with domain rules or in strict mode: its caller tail-calls guest6_steer. */
#define V6_STEER 0x7702
/* guest_ipv6's modes: judge the packet; or refuse what is not the link's
 * (counted as refused, or not: the caller counted why). */
#define V6_JUDGE 0
#define V6_REFUSE 1
#define V6_REFUSE_QUIET 2

/* Whether the guest on `ifindex` is sent IPv6 to the world (the node has
 * IPv6 egress and the sandbox may use it). */
static __always_inline int v6_router(const struct dp_config *c, __u32 ifindex)
{
	if (!(c->flags & DP_CFG_IPV6_EGRESS))
		return 0;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	return sb && (sb->flags & DP_F_V6_OUT);
}

__noinline int guest_ipv6(struct __sk_buff *skb, int mode)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	union {
		struct v6_ra ra;
		struct v6_na na;
		struct v6_rst r;
		struct v6_unreach e;
	} u;
	__u8 dmac[6];
	struct {
		struct ip6h ip;
		__u8 l4[8]; /* ICMPv6 type, code; TCP/UDP ports */
	} h;
	if (bpf_skb_load_bytes(skb, 0, dmac, sizeof(dmac)) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || (bpf_ntohl(h.ip.vtcflow) >> 28) != 6) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	/* Hop-by-hop options: MLD reports (router alert); nothing else a
	 * guest needs. Quietly. */
	if (h.ip.nexthdr == 0)
		return TC_ACT_SHOT;
	int mcast = (bpf_ntohl(h.ip.daddr[0]) >> 24) == 0xff;
	/* The link's only other node is the gateway: unicast goes to its MAC,
	 * multicast to 33:33:<low 32 bits>. */
	if (mcast ? !(dmac[0] == 0x33 && dmac[1] == 0x33) : !mac_eq(dmac, c->gateway_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count6(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	__u8 type = h.l4[0];
	int icmp = h.ip.nexthdr == IPPROTO_ICMPV6;
	/* Duplicate address detection (an NS from ::) is never answered with
	 * an NA, the guest's addresses are its own; but it means the guest's
	 * link just came up, and an RA right then spares it the wait for its
	 * link-local address and its Router Solicitation. */
	int dad = 0;
	if (!v6_is_guest(h.ip.saddr, c->guest_mac)) {
		dad = !(h.ip.saddr[0] | h.ip.saddr[1] | h.ip.saddr[2] | h.ip.saddr[3]) && icmp &&
		      type == ND_NEIGHBOR_SOLICIT;
		if (!dad) {
			count(DP_C_SPOOF_DROP);
			sb_count6(ifindex, DP_S_SPOOFED);
			return TC_ACT_SHOT;
		}
	}
	if (icmp) {
		if (type == ND_ROUTER_ADVERT || type == ND_REDIRECT) {
			count(DP_C_ROGUE_ND);
			sb_count6(ifindex, DP_S_SPOOFED);
			return TC_ACT_SHOT;
		}
		if (type >= 130 && type <= 136 && h.ip.hlim != 255)
			return TC_ACT_SHOT; /* ND and MLD come from the link only */
		if (type == ND_ROUTER_SOLICIT || dad) {
			__builtin_memset(&u.ra, 0, sizeof(u.ra));
			__u32 len = sizeof(u.ra);
			__builtin_memset(&h.ip, 0, sizeof(h.ip));
			h.ip.vtcflow = bpf_htonl(0x60000000);
			h.ip.plen = bpf_htons(len);
			h.ip.nexthdr = IPPROTO_ICMPV6;
			h.ip.hlim = 255;
			v6_eui64(h.ip.saddr, 0xfe800000, 0, c->gateway_mac);
			h.ip.daddr[0] = bpf_htonl(0xff020000); /* all nodes */
			h.ip.daddr[3] = bpf_htonl(1);
			u.ra.type = ND_ROUTER_ADVERT;
			u.ra.hop_limit = 64;
			u.ra.sll_type = 1;
			u.ra.sll_len = 1;
			__builtin_memcpy(u.ra.sll, c->gateway_mac, 6);
			u.ra.pi_type = 3;
			u.ra.pi_len = 4;
			u.ra.pi_prefix_len = 64;
			u.ra.pi_flags = 0xc0; /* on-link, autonomous */
			u.ra.pi_valid = 0xffffffff;
			u.ra.pi_preferred = 0xffffffff;
			v6_fixed(u.ra.pi_prefix, 0);
			u.ra.ri_type = 24;
			u.ra.ri_len = 1;
			u.ra.rd_type = 25;
			u.ra.rd_len = 3;
			v6_fixed(u.ra.rd_addr, DP_V6_GATEWAY_LO);
			if (c->pool6[0] | c->pool6[1] | c->pool6[2])
				u.ra.rd_lifetime = 0xffffffff;
			/* Without IPv6 egress, lifetimes 0: not a default router. */
			if (v6_router(c, ifindex)) {
				u.ra.lifetime = bpf_htons(9000);
				u.ra.ri_lifetime = 0xffffffff;
			}
			u.ra.csum = ~csum_fold32(v6_pseudo(&h.ip, len, IPPROTO_ICMPV6) +
					       csum_words(&u.ra, len));
			count(DP_C_ND_REPLY);
			if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(h.ip) + len, 0) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN, &h.ip, sizeof(h.ip), 0) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(h.ip), &u.ra, len, 0) ||
			    set_macs(skb, c->guest_mac, c->gateway_mac))
				return TC_ACT_SHOT;
			return bpf_redirect(ifindex, 0);
		}
		if (type == ND_NEIGHBOR_SOLICIT) {
			__u32 off = ETH_HLEN + sizeof(struct ip6h) + 8;
			if (bpf_skb_load_bytes(skb, off, u.na.target, sizeof(u.na.target)) ||
			    !v6_is_gateway(u.na.target, c->gateway_mac))
				return TC_ACT_SHOT; /* nobody else is on the link */
			__u32 len = sizeof(u.na) - sizeof(u.na.ip);
			u.na.ip.vtcflow = bpf_htonl(0x60000000);
			u.na.ip.plen = bpf_htons(len);
			u.na.ip.nexthdr = IPPROTO_ICMPV6;
			u.na.ip.hlim = 255;
			__builtin_memcpy(u.na.ip.saddr, u.na.target, 16);
			__builtin_memcpy(u.na.ip.daddr, h.ip.saddr, 16);
			u.na.type = ND_NEIGHBOR_ADVERT;
			u.na.code = 0;
			u.na.csum = 0;
			u.na.flags = bpf_htonl(0xe0000000); /* router, solicited, override */
			u.na.tll_type = 2;
			u.na.tll_len = 1;
			__builtin_memcpy(u.na.tll, c->gateway_mac, 6);
			u.na.csum = ~csum_fold32(v6_pseudo(&u.na.ip, len, IPPROTO_ICMPV6) +
					       csum_words(&u.na.type, len));
			count(DP_C_ND_REPLY);
			return v6_answer(skb, c, &u.na, sizeof(u.na), sizeof(u.na));
		}
		if (type == ICMP6_ECHO_REQUEST && v6_is_gateway(h.ip.daddr, c->gateway_mac)) {
			/* Turned around in place: swapping the addresses keeps
			 * the pseudo-header's sum. */
			__u32 csum_off = ETH_HLEN + sizeof(struct ip6h) + 2;
			__u32 a_off = ETH_HLEN + __builtin_offsetof(struct ip6h, saddr);
			if (bpf_skb_store_bytes(skb, a_off, h.ip.daddr, 16, 0) ||
			    bpf_skb_store_bytes(skb, a_off + 16, h.ip.saddr, 16, 0) ||
			    bpf_l4_csum_replace(skb, csum_off, bpf_htons(ICMP6_ECHO_REQUEST << 8),
						bpf_htons(ICMP6_ECHO_REPLY << 8), 2) ||
			    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(struct ip6h), &(__u8){ICMP6_ECHO_REPLY},
						1, 0) ||
			    set_macs(skb, c->guest_mac, c->gateway_mac))
				return TC_ACT_SHOT;
			count(DP_C_ND_REPLY);
			return bpf_redirect(ifindex, 0);
		}
		if (type >= 130 && type <= 143)
			return TC_ACT_SHOT; /* MLD, NA, ...: quietly */
	}
	if (h.ip.nexthdr == IPPROTO_UDP && (h.l4[0] << 8 | h.l4[1]) == 547) {
		count(DP_C_ROGUE_ND); /* a DHCPv6 server or relay */
		sb_count6(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	/* No error answers a multicast packet (RFC 4443 2.4). */
	if (mcast)
		return TC_ACT_SHOT;
	/* To the node through the gateway's unique-local address. */
	if (mode == V6_JUDGE && (c->pool6[0] | c->pool6[1] | c->pool6[2]) &&
	    v6_fixed_eq(h.ip.daddr, DP_V6_GATEWAY_LO) &&
	    (h.ip.nexthdr == IPPROTO_TCP || h.ip.nexthdr == IPPROTO_UDP ||
	     (icmp && type == ICMP6_ECHO_REPLY)))
		return V6_TO_HOST;

	/* The world (not the link, nor link-local): DNS of a sandbox with
	 * domain rules, HTTP and HTTPS of one in strict mode to guest6_steer
	 * (the agent's resolver and proxy); else, for a sandbox that may
	 * reach it, NAT66 in guest6_out. */
	__u32 d0 = bpf_ntohl(h.ip.daddr[0]);
	if (mode == V6_JUDGE && (d0 >> 22) != (0xfe800000 >> 22) &&
	    !(d0 == DP_V6_PREFIX0 && bpf_ntohl(h.ip.daddr[1]) == DP_V6_PREFIX1) &&
	    bpf_ntohl(h.ip.saddr[0]) != 0xfe800000) {
		__u16 dport = h.l4[2] << 8 | h.l4[3];
		if ((h.ip.nexthdr == IPPROTO_TCP || h.ip.nexthdr == IPPROTO_UDP) &&
		    (dport == 53 || dport == 80 || dport == 443)) {
			struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
			if (sb && (sb->flags & (dport == 53 ? DP_F_DOMAINS : DP_F_SNI)))
				return V6_STEER;
		}
		if (v6_router(c, ifindex))
			return V6_TO_WORLD;
	}
	/* Everything else has nowhere to go: refused at once. */
	if (mode != V6_REFUSE_QUIET) {
		count(DP_C_IPV6_REFUSED);
		sb_count6(ifindex, DP_S_NO_ROUTE);
	}
	__u32 l4_off = ETH_HLEN + sizeof(struct ip6h);
	if (h.ip.nexthdr == IPPROTO_TCP) {
		struct tcphdr th;
		if (bpf_skb_load_bytes(skb, l4_off, &th, sizeof(th)) || th.rst)
			return TC_ACT_SHOT;
		int partial = l4_partial(skb, l4_off + __builtin_offsetof(struct tcphdr, check));
		if (partial < 0)
			return TC_ACT_SHOT;
		__u32 plen = bpf_ntohs(h.ip.plen);
		__builtin_memset(&u.r.ip, 0, sizeof(u.r.ip));
		u.r.ip.vtcflow = bpf_htonl(0x60000000);
		u.r.ip.plen = bpf_htons(sizeof(u.r.th));
		u.r.ip.nexthdr = IPPROTO_TCP;
		u.r.ip.hlim = 64;
		__builtin_memcpy(u.r.ip.saddr, h.ip.daddr, 16);
		__builtin_memcpy(u.r.ip.daddr, h.ip.saddr, 16);
		rst_for(&th, plen > th.doff * 4u ? plen - th.doff * 4u : 0, &u.r.th);
		__u32 pseudo = v6_pseudo(&u.r.ip, sizeof(u.r.th), IPPROTO_TCP);
		if (partial)
			u.r.th.check = csum_fold32(pseudo);
		else
			u.r.th.check = ~csum_fold32(pseudo + csum_words(&u.r.th, sizeof(u.r.th)));
		return v6_answer(skb, c, &u.r, sizeof(u.r), sizeof(u.r));
	}
	if (icmp && type < 128)
		return TC_ACT_SHOT; /* never an error about an error */
	/* Destination unreachable, no route, quoting the header and the first
	 * 8 bytes after it (enough for the guest to find the socket). A
	 * partial UDP checksum stays partial: the far side sums from the
	 * ICMPv6 header and stores at its offset 6, inside the "unused" word,
	 * which receivers ignore; seeded with the pseudo-header's sum, the
	 * message's checksum comes out right wherever it is stored. */
	int partial = 0;
	if (h.ip.nexthdr == IPPROTO_UDP) {
		partial = l4_partial(skb, l4_off + 6);
		if (partial < 0)
			return TC_ACT_SHOT;
	}
	__builtin_memset(&u.e, 0, sizeof(u.e));
	__u32 len = sizeof(u.e) - sizeof(u.e.ip) + sizeof(h);
	u.e.ip.vtcflow = bpf_htonl(0x60000000);
	u.e.ip.plen = bpf_htons(len);
	u.e.ip.nexthdr = IPPROTO_ICMPV6;
	u.e.ip.hlim = 64;
	v6_eui64(u.e.ip.saddr, 0xfe800000, 0, c->gateway_mac);
	__builtin_memcpy(u.e.ip.daddr, h.ip.saddr, 16);
	u.e.type = ICMP6_DST_UNREACH;
	__u32 pseudo = v6_pseudo(&u.e.ip, len, IPPROTO_ICMPV6);
	if (partial)
		u.e.unused[1] = csum_fold32(pseudo);
	else
		u.e.csum = ~csum_fold32(pseudo + csum_words(&u.e.type, 8) + csum_words(&h, sizeof(h)));
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(u.e) + sizeof(h), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(u.e), &h, sizeof(h), 0))
		return TC_ACT_SHOT;
	return v6_answer(skb, c, &u.e, sizeof(u.e), sizeof(u.e) + sizeof(h));
}

/* guest_ipv6, its answer on the link (RA, NA, echo reply, RST,
 * unreachable: back into the guest's TAP) counted as IPv6 sent to the
 * sandbox (here: a third call's stack would not fit below guest_ipv6). */
static __always_inline int answer6(struct __sk_buff *skb, int mode)
{
	int r = guest_ipv6(skb, mode);
	if (r == TC_ACT_REDIRECT)
		traffic6(skb->ifindex, 1, skb->len);
	return r;
}

/* Whether the mapping a flow the world opened (to the uplink's address)
 * came by still maps (host port, proto) to this sandbox's
 * `container_port` (network order): a converge that removed or moved it
 * ends the flow's exemption from the egress policy. A global function:
 * from_guest's frame is full. */
__noinline int portmap_live(__u32 uplink_ip, __u32 sandbox_ip, __u32 host_port, __u32 proto,
			    __u32 container_port)
{
	struct dp_portmap_val *pm = find_portmap(uplink_ip, (__u16)host_port, (__u8)proto, 1);
	return pm && pm->sandbox_ip == sandbox_ip && pm->container_port == (__u16)container_port;
}

/* guest -> world: SNAT after the policy check, or the reply side of a
 * port-mapped flow the world opened (admitted on the way in, so not
 * subject to the sandbox's egress policy). */
static __always_inline int guest_to_world(struct __sk_buff *skb, const struct dp_config *c,
					  const struct dp_sandbox *sb, const struct iphdr *ip,
					  const struct l4info *l4)
{
	/* Guest fragments are dropped: NAT needs every piece's ports. */
	if (!c->uplink_ip || l4->frag || l4->first_frag) {
		count(DP_C_NO_ROUTE);
		sb_count(skb->ifindex, DP_S_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP_ECHO)) {
		sb_count(skb->ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}

	struct dp_ct_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.remote_ip = ip->daddr,
		.guest_port = l4->sport,
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->dport,
		.proto = l4->proto,
	};
	__u16 nat_port;
	struct dp_ct_val *v = flow_of(&key, sb->gen);
	/* A flow the world opened to a mapping is exempt from the egress
	 * policy only while the mapping still names this sandbox and port. */
	if (v && v->kind == DP_CT_PORTMAP &&
	    !portmap_live(c->uplink_ip, sb->sandbox_ip, v->nat_port, l4->proto, l4->sport)) {
		drop_stale(&key, v);
		v = NULL;
	}
	/* Only DNS, HTTP and HTTPS may be steered: other flows pay two compares. */
	__u16 dp = l4->dport;
	if ((dp == bpf_htons(53) || dp == bpf_htons(80) || dp == bpf_htons(443)) &&
	    (sb->flags & (DP_F_SNI | DP_F_DOMAINS)) && !(v && v->kind == DP_CT_PORTMAP)) {
		int r = steer_to_agent(skb);
		if (r == PROXY_STALE) {
			count(DP_C_STALE_TCP);
			sb_count(skb->ifindex, DP_S_STALE_TCP);
			return stale_reset(skb);
		}
		if (r != STEER_PASS)
			return r;
	}
	if (!(v && v->kind == DP_CT_PORTMAP) &&
	    (resolver_bypass(sb, l4) || !policy_allows(sb, ip->daddr, !v))) {
		count(DP_C_POLICY_DROP);
		sb_count(skb->ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	/* The node's own addresses never by the uplink: its services are at
	 * the gateway (169.254.68.5); a mapping at the uplink's address is
	 * reached by hairpin (forward_out), as from the world; anything else
	 * to the node, loopback or the pool is dropped. */
	if (!v && node_dst(c, ip->daddr) &&
	    !(ip->daddr == c->uplink_ip && l4->proto != IPPROTO_ICMP &&
	      find_portmap(ip->daddr, l4->dport, l4->proto, 1))) {
		count(DP_C_NODE_ADDR);
		sb_count(skb->ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	if (v) {
		touch(v, l4, DIR_OUT);
		note_close(skb, v, l4);
		nat_port = v->nat_port;
	} else if (l4->proto == IPPROTO_TCP &&
		   (l4->tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		/* Not a SYN and no flow: an evicted live flow, or a stale one. */
		if (snat_rescue(&key, sb->gen, &nat_port)) {
			count(DP_C_STALE_TCP);
			sb_count(skb->ifindex, DP_S_STALE_TCP);
			return stale_reset(skb);
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = sb->gen};
		touch(&nv, l4, DIR_OUT);
		bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
		count(DP_C_STALE_TCP_RESCUED);
	} else {
		struct syn_info si = {
			.syn = l4->proto == IPPROTO_TCP &&
			       (l4->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4->tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, l4);
		if (snat_alloc(skb, &key, sb->gen, &si, &nat_port)) {
			count(DP_C_NO_PORT);
			sb_count(skb->ifindex, DP_S_NO_PORT);
			return TC_ACT_SHOT;
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = sb->gen};
		touch(&nv, l4, DIR_OUT);
		bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
		sb_count(skb->ifindex, DP_S_NEW_SNAT);
	}
	if (set_addr(skb, IP_SRC_OFF, ip->saddr, c->uplink_ip, l4) ||
	    set_port(skb, src_port_off(l4), l4->sport, nat_port, l4))
		return TC_ACT_SHOT;
	count(DP_C_SNAT);
	if ((sb->flags & DP_F_SHAPE_OUT) && c->shaper_ifindex) {
		__u32 ifindex = skb->ifindex;
		struct dp_rate *r = bpf_map_lookup_elem(&sb_rate, &ifindex);
		if (r && r->out_small) {
			/* Through the shaper; from_shaper sends it on. */
			skb->priority = skb->len <= DP_SHAPE_SMALL ? r->out_small : r->out_bulk;
			return bpf_redirect(c->shaper_ifindex, 0);
		}
	}
	return forward_out(skb, c, ip->daddr, ip->tos, ip->protocol);
}

/* RFC 1624: a checksum after a 16-bit word of what it covers changes
 * from `from` to `to` (both as they sit in the packet). */
static __always_inline __u16 csum_upd16(__u16 check, __u16 from, __u16 to)
{
	return ~csum_fold32((__u16)~check + (__u16)~from + to);
}

/* ... after a 32-bit word (an address) changes. */
static __always_inline __u16 csum_upd32(__u16 check, __u32 from, __u32 to)
{
	return ~csum_fold32((__u16)~check + (__u16)~(from >> 16) + (__u16)~(from & 0xffff) +
			    (to >> 16) + (to & 0xffff));
}

#define ICMP_DEST_UNREACH 3
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12

/* An ICMP error from the world about a packet of a sandbox flow (a SNAT
 * flow the sandbox opened, or the sandbox's side of a port-mapped one):
 * the quoted packet left as (uplink address, NAT port); the error goes to
 * the guest as if the guest's own packet had met it: the outer
 * destination, the quoted source address and port, and the checksums
 * (outer IP, ICMP, quoted IP, quoted UDP or ICMP echo, quoted TCP when
 * the quote holds it) rewritten. Above all "fragmentation needed" (path
 * MTU discovery: dropped, a guest's large DF packets vanish on any
 * narrower link); also unreachable, time exceeded (traceroute), parameter
 * problem. Errors about nothing a live sandbox holds go to the host. */
struct icmp_err_hdrs {
	struct iphdr ip;    /* outer, no options */
	struct icmphdr icmp;
	struct iphdr in;    /* the quoted header, no options */
	__u16 l4[4];        /* its first 8 bytes after it */
};

/* Moves an ICMP error's quoted packet from address `from` and port
 * `from_port` (quoted L4 word `pw`: 0 = TCP/UDP source, 1 = destination,
 * 2 = echo id) to `to` and `to_port`, on its source side (`quoted_src`:
 * the outer destination moves too) or its destination side (the outer
 * source), with every checksum it touches: outer IP, ICMP, the quoted IP
 * header, the quoted UDP or echo checksum, and the quoted TCP checksum
 * when the quote holds it (RFC 1624 updates; the rest of the quote is
 * left as it is). Stores the headers; <0: the packet could not be read or
 * written. */
static __always_inline int icmp_err_rewrite(struct __sk_buff *skb, struct icmp_err_hdrs *h,
					    int pw, __u16 from_port, __u16 to_port, __u32 from,
					    __u32 to, int quoted_src)
{
	__u8 proto = h->in.protocol;
	__u16 ic = h->icmp.checksum;
	__u16 tcp_check = 0, tcp_new = 0;
	__u32 tcp_off = ETH_HLEN + sizeof(*h) - sizeof(h->l4) + __builtin_offsetof(struct tcphdr, check);
	int tcp_quoted = proto == IPPROTO_TCP && skb->len >= tcp_off + 2;
	if (tcp_quoted) {
		if (bpf_skb_load_bytes(skb, tcp_off, &tcp_check, 2))
			return -1;
		tcp_new = csum_upd32(csum_upd16(tcp_check, from_port, to_port), from, to);
		ic = csum_upd16(ic, tcp_check, tcp_new);
	}
	if (pw == 2) {
		__u16 old = h->l4[1];
		h->l4[1] = csum_upd16(old, from_port, to_port);
		ic = csum_upd16(ic, old, h->l4[1]);
		h->l4[2] = to_port;
	} else if (pw) {
		h->l4[1] = to_port;
	} else {
		h->l4[0] = to_port;
	}
	ic = csum_upd16(ic, from_port, to_port);
	if (proto == IPPROTO_UDP && h->l4[3]) {
		__u16 old = h->l4[3];
		__u16 n = csum_upd32(csum_upd16(old, from_port, to_port), from, to);
		h->l4[3] = n ? n : 0xffff;
		ic = csum_upd16(ic, old, h->l4[3]);
	}
	__u16 in_check = h->in.check;
	h->in.check = csum_upd32(in_check, from, to);
	if (quoted_src) {
		h->in.saddr = to;
		h->ip.check = csum_upd32(h->ip.check, h->ip.daddr, to);
		h->ip.daddr = to;
	} else {
		h->in.daddr = to;
		h->ip.check = csum_upd32(h->ip.check, h->ip.saddr, to);
		h->ip.saddr = to;
	}
	h->icmp.checksum = csum_upd16(csum_upd32(ic, from, to), in_check, h->in.check);
	if (bpf_skb_store_bytes(skb, ETH_HLEN, h, sizeof(*h), 0) ||
	    (tcp_quoted && bpf_skb_store_bytes(skb, tcp_off, &tcp_new, 2, 0)))
		return -1;
	return 0;
}

__noinline int icmp_error_in(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_OK;
	struct icmp_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || h.ip.ihl != 5 ||
	    h.in.version != 4 || h.in.ihl != 5 || h.in.saddr != c->uplink_ip ||
	    (h.in.frag_off & bpf_htons(IP_OFFSET)))
		return TC_ACT_OK;
	__u8 proto = h.in.protocol;
	__u16 nat_port, remote_port;
	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP) {
		nat_port = h.l4[0];
		remote_port = h.l4[1];
	} else if (proto == IPPROTO_ICMP && ((__u8 *)h.l4)[0] == ICMP_ECHO) {
		nat_port = h.l4[2]; /* the echo id */
		remote_port = 0;
	} else {
		return TC_ACT_OK;
	}
	struct dp_ct_key key = {
		.remote_ip = h.in.daddr,
		.remote_port = remote_port,
		.proto = proto,
	};
	__u8 kind;
	__u64 gen;
	struct dp_rev_key rk = {
		.remote_ip = h.in.daddr,
		.remote_port = remote_port,
		.nat_port = nat_port,
		.proto = proto,
	};
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
	if (rv) {
		if (!rv->sandbox_ip)
			return TC_ACT_OK; /* a host connection to_uplink moved */
		key.sandbox_ip = rv->sandbox_ip;
		key.guest_port = rv->guest_port;
		gen = rv->gen;
		kind = DP_CT_SNAT;
	} else {
		if (proto == IPPROTO_ICMP)
			return TC_ACT_OK;
		struct dp_portmap_val *pm = find_portmap(c->uplink_ip, nat_port, proto, 1);
		if (!pm)
			return TC_ACT_OK;
		key.sandbox_ip = pm->sandbox_ip;
		key.guest_port = pm->container_port;
		struct dp_tap *t = bpf_map_lookup_elem(&by_ip, &key.sandbox_ip);
		if (!t)
			return TC_ACT_OK;
		gen = t->gen;
		kind = DP_CT_PORTMAP;
	}
	/* Only a live flow of the address's current owner: an error never
	 * reaches a sandbox about packets it did not send. */
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
	if (!v || v->gen != gen || v->nat_port != nat_port || v->kind != kind)
		return TC_ACT_OK;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &key.sandbox_ip);
	if (!tap || tap->gen != gen)
		return TC_ACT_OK;
	if (tap->flags & DP_T_PAUSED)
		return TC_ACT_SHOT;
	__u32 tap_ifindex = tap->ifindex;

	if (icmp_err_rewrite(skb, &h, proto == IPPROTO_ICMP ? 2 : 0, nat_port, key.guest_port,
			     c->uplink_ip, c->guest_ip, 1) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return bpf_redirect(tap_ifindex, 0);
}

/* The other way: an ICMP error a guest sends about a packet of a flow it
 * holds (a port-mapped flow the world opened, or a reply to one it
 * opened: "port unreachable" above all) leaves as the node's: the outer
 * source, the quoted destination address and port (what the world sent
 * to: the uplink address and the flow's NAT or host port) and the
 * checksums are rewritten. Not subject to the egress policy (the flow was
 * admitted, and the error goes to the flow's remote only); anything about
 * no live flow of this sandbox is dropped. */
__noinline int icmp_error_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct icmp_err_hdrs h;
	if (!sb || !c->uplink_ip || bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) ||
	    h.ip.ihl != 5 || h.in.version != 4 || h.in.ihl != 5 || h.in.daddr != c->guest_ip ||
	    h.in.saddr != h.ip.daddr || (h.in.frag_off & bpf_htons(IP_OFFSET)) ||
	    (h.in.protocol != IPPROTO_TCP && h.in.protocol != IPPROTO_UDP))
		goto drop;
	struct dp_ct_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.remote_ip = h.in.saddr,
		.guest_port = h.l4[1],
		.remote_port = h.l4[0],
		.proto = h.in.protocol,
	};
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
	if (!v || v->gen != sb->gen)
		goto drop;
	if (icmp_err_rewrite(skb, &h, 1, key.guest_port, v->nat_port, c->guest_ip, c->uplink_ip, 0))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return forward_out(skb, c, h.ip.daddr, h.ip.tos, IPPROTO_ICMP);
drop:
	sb_count(ifindex, DP_S_UNSUPPORTED);
	return TC_ACT_SHOT;
}

/* ---- NAT66 (docs/dual-stack.md): the IPv6 twins of the SNAT path ---- */

/* Whether `d` is a destination the world may be sent to over IPv6 by
 * default: global unicast (2000::/3) but for the blocks that embed an
 * IPv4 address, which would slip past the IPv4 rules, or are IETF
 * protocol assignments (2001::/23, Teredo 2001::/32 among them; 2002::/16
 * 6to4). Everything else never is: ULAs fc00::/7 (the v6 metadata address
 * fd00:ec2::254 among them), link-local, multicast, loopback, ::,
 * v4-mapped ::ffff:0:0/96 and NAT64 64:ff9b::/96. */
static __always_inline int v6_world(const __u32 *d)
{
	__u32 a0 = bpf_ntohl(d[0]);
	if ((a0 >> 29) != 1)
		return 0;
	if ((a0 >> 16) == 0x2002 || (a0 & 0xfffffe00) == 0x20010000)
		return 0;
	return 1;
}

/* Whether a sandbox with IPv6 rules (DP_F_V6_RULES) may send to `d`, as
 * policy_allows for IPv4: only unicast a NAT can reach (global 2000::/3
 * and unique-local fc00::/7, less the sandboxes' own link, the metadata
 * address and the prefixes that embed IPv4 addresses: 6to4 and
 * 2001::/23, which the IPv4 rules judge); then an allow CIDR; a unique-local address only under
 * one (as the v6 world of a sandbox without rules has none); then a deny
 * CIDR other than the catch-all drops; then an address the resolver
 * learned for the sandbox (AAAA, dns_learned6; `fresh`: no flow yet);
 * then the catch-all. A global function: its own frame (guest6_out's is
 * full), verified once. */
__noinline int policy6_allows(const struct dp_sandbox *sb, const struct dp_in6 *d, int fresh)
{
	if (!sb || !d)
		return 0;
	__u32 a0 = bpf_ntohl(d->w[0]);
	int ula = (a0 >> 25) == (0xfc000000u >> 25);
	if ((a0 >> 29) != 1 && !ula)
		return 0;
	if ((a0 >> 16) == 0x2002 || (a0 & 0xfffffe00) == 0x20010000)
		return 0;
	if (a0 == DP_V6_PREFIX0 && bpf_ntohl(d->w[1]) == DP_V6_PREFIX1)
		return 0;
	/* The cloud metadata address fd00:ec2::254: never, not even under an
	 * allow CIDR (::/0 is a likely way to write "all IPv6"). */
	if (a0 == 0xfd000ec2 && !d->w[1] && !d->w[2] && d->w[3] == bpf_htonl(0x254))
		return 0;
	struct dp_policy6_key pk = {.prefixlen = 160, .sandbox_ip = sb->sandbox_ip};
	__builtin_memcpy(pk.dst, d->w, 16);
	if (bpf_map_lookup_elem(&policy6_allow, &pk))
		return 1;
	if (ula)
		return 0;
	__u8 *deny = bpf_map_lookup_elem(&policy6_deny, &pk);
	if (deny && *deny != DP_DENY_CATCH_ALL)
		return 0;
	if (sb->flags & DP_F_DOMAINS) {
		struct dp_learned6_key lk = {.sandbox_ip = sb->sandbox_ip};
		__builtin_memcpy(lk.dst, d->w, 16);
		struct dp_learned_val *lv = bpf_map_lookup_elem(&dns_learned6, &lk);
		if (lv && lv->gen == sb->gen && (!fresh || lv->expires_ns > bpf_ktime_get_ns()))
			return 1;
	}
	return !deny;
}

static __always_inline int v6_eq(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* The IPv6 twin of host_socket (saddr:sport -> daddr:dport as it arrives). */
static __always_inline int host_socket6(struct __sk_buff *skb, __u8 proto, const __u32 *saddr,
					__u16 sport, const __u32 *daddr, __u16 dport)
{
	struct bpf_sock_tuple t = {};
	__builtin_memcpy(t.ipv6.saddr, saddr, 16);
	__builtin_memcpy(t.ipv6.daddr, daddr, 16);
	t.ipv6.sport = sport;
	t.ipv6.dport = dport;
	if (proto == IPPROTO_TCP) {
		struct bpf_sock *sk =
			bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	if (proto == IPPROTO_UDP) {
		struct bpf_sock *sk =
			bpf_sk_lookup_udp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return 0;
		bpf_sk_release(sk);
		return 1;
	}
	return 0;
}

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

/* Replaces an IPv6 address (at `off`), fixing the pseudo-header part of
 * the L4 checksum (TCP, UDP and ICMPv6 all cover it). */
static __always_inline int set_addr6(struct __sk_buff *skb, __u32 off, const __u32 *old,
				     const __u32 *new, const struct l4info *l4)
{
	__s64 diff = bpf_csum_diff((__u32 *)old, 16, (__u32 *)new, 16, 0);
	if (diff < 0 ||
	    bpf_l4_csum_replace(skb, l4->csum_off, 0, diff, BPF_F_PSEUDO_HDR | l4_csum_flags(l4)))
		return -1;
	return bpf_skb_store_bytes(skb, off, (__u32 *)new, 16, 0);
}

/* Parses an IPv6 packet's TCP, UDP or ICMPv6 header right after the fixed
 * one (no extension headers: a guest's fragments are dropped, as IPv4's). */
static __always_inline int parse_ipv6(struct __sk_buff *skb, struct ip6h *ip,
				      struct l4info *l4)
{
	if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(*ip)) ||
	    (bpf_ntohl(ip->vtcflow) >> 28) != 6)
		return -1;
	__builtin_memset(l4, 0, sizeof(*l4));
	l4->proto = ip->nexthdr;
	l4->off = ETH_HLEN + sizeof(*ip);
	if (ip->nexthdr == IPPROTO_TCP || ip->nexthdr == IPPROTO_UDP) {
		return parse_ports(skb, l4, bpf_ntohs(ip->plen));
	} else if (ip->nexthdr == IPPROTO_ICMPV6) {
		__u8 ih[8];
		if (bpf_skb_load_bytes(skb, l4->off, ih, sizeof(ih)))
			return -1;
		l4->icmp_type = ih[0];
		l4->sport = *(__u16 *)&ih[4]; /* echo id */
		l4->dport = l4->sport;
		l4->csum_off = l4->off + 2;
		/* src_port_off/dst_port_off find the id at 4, as ICMP's. */
		l4->proto = IPPROTO_ICMP;
	}
	return 0;
}

/* Out of the uplink to `daddr` (see forward_out). */
static __always_inline int forward_out6(struct __sk_buff *skb, const struct dp_config *c,
					const __u32 *daddr, __u8 proto)
{
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET6;
	fib.l4_protocol = proto;
	fib.tot_len = 0;
	__builtin_memcpy(fib.ipv6_src, c->uplink_ip6, 16);
	__builtin_memcpy(fib.ipv6_dst, daddr, 16);
	fib.ifindex = c->uplink_ifindex;
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (set_macs(skb, fib.dmac, fib.smac))
			return TC_ACT_SHOT;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {.nh_family = AF_INET6};
		__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16);
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED)
		return bpf_redirect_neigh(c->uplink_ifindex, NULL, 0, 0);
	count(DP_C_NO_ROUTE);
	sb_count6(skb->ifindex, DP_S_NO_ROUTE);
	return TC_ACT_SHOT;
}

/* Whether the mapping a flow the world opened came by still maps (host
 * port, proto) to this sandbox's `container_port` (network order): a
 * converge that removed or moved it ends the flow's exemption from the
 * egress policy. A global function: guest6_out's frame is full. */
__noinline int portmap6_live(__u32 sandbox_ip, __u32 host_port, __u32 proto, __u32 container_port)
{
	struct dp_portmap_key pk = {.host_port = (__u16)host_port, .proto = (__u8)proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	return pm && pm->sandbox_ip == sandbox_ip && pm->container_port == (__u16)container_port;
}

/* guest -> the IPv6 world (from_guest's tail call, after guest_ipv6 checked
 * the link: source, MACs, an off-link unicast destination, a sandbox with
 * DP_F_V6_OUT): the default denies, then NAT66 to the uplink's address
 * with a port of the SNAT range, as guest_to_world does for IPv4. */
SEC("classifier")
int guest6_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!c || !sb || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_SHOT;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (l4.proto == IPPROTO_ICMP && l4.icmp_type >= ICMP6_DST_UNREACH &&
	    l4.icmp_type <= ICMP6_PARAM_PROB) {
		/* An error about a flow it holds: translated in icmp6_error. */
		bpf_tail_call(skb, &tails, TAIL_ICMP6_ERROR);
		sb_count6(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST)) {
		sb_count6(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4.sport,
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.proto = l4.proto,
		.gaddr = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__builtin_memcpy(key.remote_ip, ip.daddr, 16);
	__u64 gen = sb->gen;
	__u16 nat_port;
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	if (v && (v->gen != gen ||
		  (v->kind == DP_CT_PORTMAP &&
		   !portmap6_live(sb->sandbox_ip, v->nat_port, l4.proto, l4.sport)))) {
		drop_stale6(&key, v);
		v = NULL;
	}
	/* The policy on every packet, as IPv4's (a changed rule stops a flow),
	 * but for the replies of a flow the world opened to a port mapping;
	 * DNS and DNS-over-TLS of a sandbox with domain rules go to the
	 * agent's resolver only, which is IPv4's: dropped here. */
	if (!(v && v->kind == DP_CT_PORTMAP) &&
	    (!(sb->flags & DP_F_INTERNET) || resolver_bypass(sb, &l4) ||
	    !((sb->flags & DP_F_V6_RULES)
		      ? policy6_allows(sb, (const struct dp_in6 *)ip.daddr, !v)
		      : v6_world(ip.daddr)))) {
		count(DP_C_POLICY_DROP);
		sb_count6(ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	/* The node's own addresses never by the uplink (IPv6 has no hairpin:
	 * mappings are reached over IPv4's). */
	if (!v && node_dst6((const struct dp_in6 *)ip.daddr)) {
		count(DP_C_NODE_ADDR);
		sb_count6(ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	if (v) {
		touch(v, &l4, DIR_OUT);
		note_close(skb, v, &l4);
		nat_port = v->nat_port;
	} else if (l4.proto == IPPROTO_TCP &&
		   (l4.tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN) {
		if (snat6_rescue(&key, gen, &nat_port)) {
			count(DP_C_STALE_TCP);
			sb_count6(ifindex, DP_S_STALE_TCP);
			/* Its RST, from guest_ipv6 (whose stack and this one's
			 * do not fit one call chain). */
			bpf_tail_call(skb, &tails, TAIL_GUEST6_RST);
			return TC_ACT_SHOT;
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = gen};
		touch(&nv, &l4, DIR_OUT);
		bpf_map_update_elem(&ct6, &key, &nv, BPF_ANY);
		count(DP_C_STALE_TCP_RESCUED);
	} else {
		struct syn_info si = {
			.syn = l4.proto == IPPROTO_TCP &&
			       (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4.tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, &l4);
		if (snat6_alloc(skb, &key, gen, &si, &nat_port)) {
			count(DP_C_NO_PORT);
			sb_count6(ifindex, DP_S_NO_PORT);
			return TC_ACT_SHOT;
		}
		struct dp_ct_val nv = {.nat_port = nat_port, .kind = DP_CT_SNAT, .gen = gen};
		touch(&nv, &l4, DIR_OUT);
		bpf_map_update_elem(&ct6, &key, &nv, BPF_ANY);
		sb_count6(ifindex, DP_S_NEW_SNAT);
	}
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip.saddr,
		      c->uplink_ip6, &l4) ||
	    set_port(skb, src_port_off(&l4), l4.sport, nat_port, &l4))
		return TC_ACT_SHOT;
	count(DP_C_NAT66);
	if ((sb->flags & DP_F_SHAPE_OUT) && c->shaper_ifindex) {
		struct dp_rate *r = bpf_map_lookup_elem(&sb_rate, &ifindex);
		if (r && r->out_small) {
			skb->priority = skb->len <= DP_SHAPE_SMALL ? r->out_small : r->out_bulk;
			return bpf_redirect(c->shaper_ifindex, 0);
		}
	}
	return forward_out6(skb, c, ip.daddr, ip.nexthdr);
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

/* A world packet to the uplink's IPv6 address on a port mapped on every
 * node address (IPv6 has no per-address mappings): the flow to the
 * guest's current address (guest_fixed6), opened by this packet or
 * running, as from_uplink's for IPv4. NULL: the node's (no
 * such mapping; a host socket wins a new flow; a sandbox whose IPv6 does
 * not reach the world, whose guest has no route back: the node refuses,
 * and a client falls back to IPv4 at once). */
static __always_inline struct dp_tap *portmap6_in(struct __sk_buff *skb, const struct ip6h *ip,
						  const struct l4info *l4, struct dp_ct6_key *key)
{
	if (l4->proto == IPPROTO_ICMP)
		return NULL;
	struct dp_portmap_key pk = {.host_port = l4->dport, .proto = l4->proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (!pm)
		return NULL;
	__u32 sandbox_ip = pm->sandbox_ip;
	__u16 container_port = pm->container_port;
	int wins = pm->flags & DP_PM_WINS;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return NULL;
	__u32 ifindex = tap->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb || !(sb->flags & DP_F_V6_OUT))
		return NULL;
	__builtin_memset(key, 0, sizeof(*key));
	key->sandbox_ip = sandbox_ip;
	__builtin_memcpy(key->remote_ip, ip->saddr, 16);
	key->guest_port = container_port;
	key->remote_port = l4->sport;
	key->proto = l4->proto;
	struct dp_ct_val *v = ct6_to_guest(key, ifindex, tap->gen);
	if (v && (v->gen != tap->gen || v->kind != DP_CT_PORTMAP)) {
		/* An earlier owner's flow, or the guest's own from this port to
		 * this client: this packet opens a mapped flow. */
		drop_stale6(key, v);
		v = NULL;
	}
	if (opens_flow(v, l4) && !wins &&
	    host_socket6(skb, l4->proto, ip->saddr, l4->sport, ip->daddr, l4->dport)) {
		/* A host socket listens on (or is bound to) this port: the host
		 * wins for new flows, as for IPv4. */
		if (v)
			bpf_map_delete_elem(&ct6, key);
		count(DP_C_PORTMAP_HOST_SOCKET);
		return NULL;
	}
	if (v) {
		touch(v, l4, DIR_IN);
	} else {
		struct dp_ct_val nv = {.nat_port = l4->dport, .kind = DP_CT_PORTMAP,
				       .gen = tap->gen};
		touch(&nv, l4, DIR_IN);
		bpf_map_update_elem(&ct6, key, &nv, BPF_ANY);
		sb_count6(ifindex, DP_S_NEW_PORTMAP);
	}
	count(DP_C_PORTMAP);
	return tap;
}

/* The guest's address a NAT66 flow was sent from. */
static __always_inline void v6_guest_addr(__u32 *a, __u8 gaddr, const struct dp_config *c)
{
	if (gaddr == DP_GADDR_FIXED)
		v6_fixed(a, DP_V6_GUEST_LO);
	else
		v6_eui64(a, DP_V6_PREFIX0, DP_V6_PREFIX1, c->guest_mac);
}

/* RFC 1624 for a 128-bit word (an IPv6 address) of what a checksum covers. */
static __always_inline __u16 csum_upd128(__u16 check, const __u32 *from, const __u32 *to)
{
	__u32 sum = (__u16)~check;
	for (int i = 0; i < 4; i++)
		sum += (__u16)~(from[i] >> 16) + (__u16)~(from[i] & 0xffff) + (to[i] >> 16) +
		       (to[i] & 0xffff);
	return ~csum_fold32(sum);
}

/* An ICMPv6 error and the packet it quotes (no extension headers). */
struct icmp6_err_hdrs {
	struct ip6h ip;
	__u8 type, code;
	__u16 csum;
	__u32 info;          /* Packet Too Big: the MTU */
	struct ip6h in;      /* the quoted header */
	__u16 l4[4];         /* its first 8 bytes after it */
};

/* The live flow of a port mapping on every node address whose packets to
 * the world have the tuple `rk` (sent from the uplink's IPv6 address and
 * the host port `rk->nat_port`): its key in `k` and its sandbox's TAP;
 * NULL when there is none. */
static __always_inline struct dp_tap *portmap6_flow(const struct dp_rev6_key *rk,
						    struct dp_ct6_key *k)
{
	struct dp_portmap_key pk = {.host_port = rk->nat_port, .proto = rk->proto};
	struct dp_portmap_val *pm = bpf_map_lookup_elem(&portmap, &pk);
	if (!pm)
		return NULL;
	__u32 sandbox_ip = pm->sandbox_ip;
	__builtin_memset(k, 0, sizeof(*k));
	k->sandbox_ip = sandbox_ip;
	__builtin_memcpy(k->remote_ip, rk->remote_ip, 16);
	k->guest_port = pm->container_port;
	k->remote_port = rk->remote_port;
	k->proto = rk->proto;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return NULL;
	struct dp_ct_val *v = ct6_to_guest(k, tap->ifindex, tap->gen);
	if (!v || v->gen != tap->gen || v->kind != DP_CT_PORTMAP || v->nat_port != rk->nat_port)
		return NULL;
	return tap;
}

/* Rewrites an ICMPv6 error and the packet it quotes for the other side of
 * a translated flow: the address `from` (with `in`: the outer destination
 * and the quoted source, the uplink's; else the outer source and the
 * quoted destination, the guest's) becomes `to`, the quoted port
 * `from_port` becomes `to_port`, and every checksum they touch follows. */
static __always_inline int icmp6_err_rewrite(struct __sk_buff *skb, struct icmp6_err_hdrs *h,
					     int in, __u16 from_port, __u16 to_port,
					     const __u32 *to)
{
	__u8 proto = h->in.nexthdr;
	int echo = proto == IPPROTO_ICMPV6;
	__u32 from[4];
	__builtin_memcpy(from, in ? h->in.saddr : h->in.daddr, 16);
	__u16 ic = csum_upd128(h->csum, from, to); /* the outer address */
	ic = csum_upd128(ic, from, to);            /* the quoted one */
	ic = csum_upd16(ic, from_port, to_port);
	/* The quoted L4 checksum (pseudo-header: the quoted address; and the
	 * port): UDP's and echo's are in the 8 bytes, TCP's when quoted. */
	__u32 tcp_off = ETH_HLEN + sizeof(*h) - sizeof(h->l4) + __builtin_offsetof(struct tcphdr, check);
	__u16 tcp_check = 0, tcp_new = 0;
	int tcp_quoted = proto == IPPROTO_TCP && skb->len >= tcp_off + 2;
	if (tcp_quoted) {
		if (bpf_skb_load_bytes(skb, tcp_off, &tcp_check, 2))
			return -1;
		tcp_new = csum_upd128(csum_upd16(tcp_check, from_port, to_port), from, to);
		ic = csum_upd16(ic, tcp_check, tcp_new);
	}
	int cw = echo ? 1 : 3; /* the quoted checksum's word */
	if (proto != IPPROTO_TCP) {
		__u16 old = h->l4[cw];
		__u16 n = csum_upd128(csum_upd16(old, from_port, to_port), from, to);
		h->l4[cw] = n = (n || echo) ? n : 0xffff; /* UDP: 0 is "none" */
		ic = csum_upd16(ic, old, n);
	}
	if (in) {
		h->l4[echo ? 2 : 0] = to_port;
		__builtin_memcpy(h->in.saddr, to, 16);
		__builtin_memcpy(h->ip.daddr, to, 16);
	} else {
		h->l4[1] = to_port;
		__builtin_memcpy(h->in.daddr, to, 16);
		__builtin_memcpy(h->ip.saddr, to, 16);
	}
	h->csum = ic;
	if (bpf_skb_store_bytes(skb, ETH_HLEN, h, sizeof(*h), 0) ||
	    (tcp_quoted && bpf_skb_store_bytes(skb, tcp_off, &tcp_new, 2, 0)))
		return -1;
	return 0;
}

/* A guest's ICMPv6 error about a packet of a flow it holds (a port-mapped
 * flow the world opened, or the replies of one it opened: "port
 * unreachable", or Packet Too Big from a guest whose link is narrower)
 * leaves as the node's, as icmp_error_out does for IPv4: the outer source,
 * the quoted destination address and port (what the world sent to: the
 * uplink's address and the flow's NAT or host port) and the checksums are
 * rewritten. Anything about no live flow of this sandbox is dropped. */
static __always_inline int icmp6_error_out(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb)
{
	__u32 ifindex = skb->ifindex;
	struct icmp6_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) || !v6_eq(h.in.saddr, h.ip.daddr) ||
	    (h.in.nexthdr != IPPROTO_TCP && h.in.nexthdr != IPPROTO_UDP))
		goto drop;
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = h.l4[1],
		.remote_port = h.l4[0],
		.proto = h.in.nexthdr,
		.gaddr = v6_fixed_eq(h.in.daddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__u32 guest[4];
	v6_guest_addr(guest, key.gaddr, c);
	if (!v6_eq(h.in.daddr, guest) || !v6_eq(h.ip.saddr, guest))
		goto drop;
	__builtin_memcpy(key.remote_ip, h.in.saddr, 16);
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	if (!v || v->gen != sb->gen ||
	    (v->kind == DP_CT_PORTMAP &&
	     !portmap6_live(sb->sandbox_ip, v->nat_port, key.proto, key.guest_port)))
		goto drop;
	if (icmp6_err_rewrite(skb, &h, 0, key.guest_port, v->nat_port, c->uplink_ip6))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return forward_out6(skb, c, h.ip.daddr, IPPROTO_ICMPV6);
drop:
	sb_count6(ifindex, DP_S_UNSUPPORTED);
	return TC_ACT_SHOT;
}

/* ICMPv6 errors about translated flows, both ways (a program of its own,
 * the tail call of uplink6_in and of guest6_out: its stack and theirs do
 * not fit one call chain).
 *
 * From a sandbox's TAP: icmp6_error_out. From the world: an error about a
 * packet of a NAT66 flow (quoted as sent: from the uplink's address and
 * the NAT port) or of a port-mapped flow (from the host port) goes to the
 * guest as if its own packet had met it, the outer destination, the
 * quoted source address and port and every checksum they touch
 * rewritten. Above all Packet Too Big: IPv6 routers never fragment, so
 * without it a guest's large packets vanish on any narrower link. Errors
 * about nothing a live sandbox holds go to the node. */
SEC("classifier")
int icmp6_error(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (sb)
		return c ? icmp6_error_out(skb, c, sb) : TC_ACT_SHOT;
	if (!c)
		return TC_ACT_OK;
	struct icmp6_err_hdrs h;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &h, sizeof(h)) ||
	    !v6_eq(h.in.saddr, c->uplink_ip6))
		return TC_ACT_OK;
	__u8 proto = h.in.nexthdr;
	int echo = proto == IPPROTO_ICMPV6;
	if (echo ? (h.l4[0] & 0xff) != ICMP6_ECHO_REQUEST
		 : proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return TC_ACT_OK;
	struct dp_rev6_key rk = {
		.remote_port = echo ? 0 : h.l4[1],
		.nat_port = echo ? h.l4[2] : h.l4[0],
		.proto = echo ? IPPROTO_ICMP : proto,
	};
	__builtin_memcpy(rk.remote_ip, h.in.daddr, 16);
	struct dp_ct6_key k;
	struct dp_ct_val *v;
	struct dp_tap *tap = nat66_flow(&rk, &k, &v);
	if (!tap && !echo)
		tap = portmap6_flow(&rk, &k);
	if (!tap)
		return TC_ACT_OK;
	if (tap->flags & DP_T_PAUSED)
		return paused_drop6(tap->ifindex, tap->gen, k.sandbox_ip,
				    (const struct dp_in6 *)rk.remote_ip,
				    wake_what(k.guest_port, rk.remote_port, rk.proto, DP_WAKE_REPLY));
	__u32 tap_ifindex = tap->ifindex;
	__u32 guest[4];
	v6_guest_addr(guest, k.gaddr, c);
	if (icmp6_err_rewrite(skb, &h, 1, rk.nat_port, k.guest_port, guest) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_ICMP_ERROR);
	return to_guest6(skb, tap_ifindex);
}

/* A guest's TCP segment to the IPv6 world of a flow it never opened gets
 * the RST a closed port sends (guest6_out counted it as stale). */
SEC("classifier")
int guest6_rst(struct __sk_buff *skb)
{
	return answer6(skb, V6_REFUSE_QUIET);
}

/* The world's packet `ip`/`l4` to the uplink's IPv6 address: a NAT66
 * flow's reply or a port mapping's, to its guest; else the node's. With
 * `frag` (the first fragment of a datagram), its later fragments are sent
 * after it (frags6). */
static __always_inline int uplink6_deliver(struct __sk_buff *skb, const struct dp_config *c,
					   const struct ip6h *ip, struct l4info *l4,
					   const struct dp_frag6_key *frag)
{
	if (l4->proto == IPPROTO_ICMP && l4->icmp_type >= ICMP6_DST_UNREACH &&
	    l4->icmp_type <= ICMP6_PARAM_PROB)
	{
		bpf_tail_call(skb, &tails, TAIL_ICMP6_ERROR);
		return TC_ACT_OK;
	}
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP6_ECHO_REPLY))
		return TC_ACT_OK;
	struct dp_rev6_key rk = {
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->sport,
		.nat_port = l4->dport,
		.proto = l4->proto,
	};
	__builtin_memcpy(rk.remote_ip, ip->saddr, 16);
	struct dp_ct6_key key;
	struct dp_ct_val *v;
	struct dp_tap *tap = nat66_flow(&rk, &key, &v);
	__u8 wake = DP_WAKE_REPLY;
	if (tap) {
		touch(v, l4, DIR_IN);
		count(DP_C_NAT66_REPLY);
	} else {
		tap = portmap6_in(skb, ip, l4, &key);
		if (!tap)
			return TC_ACT_OK; /* the node's own */
		wake = DP_WAKE_PORTMAP;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u16 guest_port = key.guest_port;
	if (tap->flags & DP_T_PAUSED)
		return paused_drop6(tap_ifindex, tap->gen, key.sandbox_ip,
				    (const struct dp_in6 *)rk.remote_ip,
				    wake_what(guest_port, rk.remote_port, l4->proto, wake));
	if (tap->flags & DP_T_SHAPE_IN)
		skb->priority = skb->len <= DP_SHAPE_SMALL ? DP_TAP_CLASS_SMALL : DP_TAP_CLASS_BULK;
	__u32 guest[4];
	v6_guest_addr(guest, key.gaddr, c);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip->daddr, guest,
		      l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, guest_port, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	if (frag) {
		struct dp_frag6_val fv = {
			.first_seen_ns = bpf_ktime_get_ns(),
			.gen = tap->gen,
			.ifindex = tap_ifindex,
			.gaddr = key.gaddr,
		};
		bpf_map_update_elem(&frags6, frag, &fv, BPF_ANY);
	}
	return to_guest6(skb, tap_ifindex);
}

/* the IPv6 world -> a NAT66 flow's guest (from_uplink's tail call): the
 * reply side of guest6_out. Anything else is the node's own. */
SEC("classifier")
int uplink6_in(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_OK;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4) || !v6_eq(ip.daddr, c->uplink_ip6))
		return TC_ACT_OK;
	if (ip.nexthdr == IPPROTO_FRAGMENT) {
		bpf_tail_call(skb, &tails, TAIL_UPLINK6_FRAG);
		return TC_ACT_OK;
	}
	return uplink6_deliver(skb, c, &ip, &l4, NULL);
}

/* A fragment from the world to the uplink's IPv6 address (uplink6_in's
 * tail call; no other extension header before it). The first one (offset
 * 0), which holds the UDP or TCP header, goes where uplink6_in would send
 * the whole datagram (a NAT66 flow's reply, a port mapping), translated
 * the same way (the L4 checksum covers the whole datagram: the
 * incremental update holds), and is noted in frags6; the later ones
 * follow it to the same guest address with only their destination
 * rewritten (IPv6 has no header checksum; they carry no ports). Anything
 * else, and a fragment whose first sibling has not come or whose sandbox
 * has a new owner, is the node's (its reassembly times out). */
SEC("classifier")
int uplink6_frag(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !(c->flags & DP_CFG_IPV6_EGRESS))
		return TC_ACT_OK;
	struct ip6h ip;
	struct {
		__u8 nexthdr, reserved;
		__u16 frag_off; /* the offset in 8-byte units << 3, M in bit 0 */
		__u32 id;
	} fh;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(ip), &fh, sizeof(fh)))
		return TC_ACT_OK;
	struct dp_frag6_key fk = {.id = fh.id};
	__builtin_memcpy(fk.saddr, ip.saddr, 16);
	if (bpf_ntohs(fh.frag_off) & 0xfff8) {
		struct dp_frag6_val *fv = bpf_map_lookup_elem(&frags6, &fk);
		if (!fv || bpf_ktime_get_ns() - fv->first_seen_ns > FRAG_TTL_NS)
			return TC_ACT_OK;
		__u32 ifindex = fv->ifindex;
		__u64 gen = fv->gen;
		__u8 gaddr = fv->gaddr;
		struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
		if (!sb || sb->gen != gen)
			return TC_ACT_OK;
		__u32 guest[4];
		v6_guest_addr(guest, gaddr, c);
		if (bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), guest,
					16, 0) ||
		    set_macs(skb, c->guest_mac, c->gateway_mac))
			return TC_ACT_SHOT;
		count(DP_C_FRAG);
		return to_guest6(skb, ifindex);
	}
	if (fh.nexthdr != IPPROTO_TCP && fh.nexthdr != IPPROTO_UDP)
		return TC_ACT_OK;
	struct l4info l4 = {.proto = fh.nexthdr, .off = ETH_HLEN + sizeof(ip) + sizeof(fh)};
	__u32 plen = bpf_ntohs(ip.plen);
	if (plen < sizeof(fh) || parse_ports(skb, &l4, plen - sizeof(fh)))
		return TC_ACT_OK;
	/* An atomic fragment (M = 0) is a whole datagram: nothing follows. */
	return uplink6_deliver(skb, c, &ip, &l4, (bpf_ntohs(fh.frag_off) & 1) ? &fk : NULL);
}

/* The node's own IPv6 packet out of the uplink (to_uplink): on a tuple a
 * live sandbox flow holds, it would take that flow's replies, so it is
 * dropped (the SNAT range is the sandboxes'; snat6_alloc never takes a
 * tuple a node socket already has). */
__noinline int to_uplink6(struct __sk_buff *skb)
{
	/* A global function: verified once, apart from to_uplink's IPv4
	 * paths (together past the verifier's budget). */
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_OK;
	struct ip6h ip;
	struct l4info l4;
	if (parse_ipv6(skb, &ip, &l4) || !v6_eq(ip.saddr, c->uplink_ip6))
		return TC_ACT_OK;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST))
		return TC_ACT_OK;
	__u16 port = bpf_ntohs(l4.sport);
	if (port < c->snat_port_min || port > c->snat_port_max)
		return TC_ACT_OK;
	__u32 iif = skb->ingress_ifindex;
	if (iif && (iif == c->shaper_peer_ifindex || bpf_map_lookup_elem(&sandboxes, &iif)))
		return TC_ACT_OK; /* a sandbox's, translated */
	struct dp_rev6_key rk = {
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.nat_port = l4.sport,
		.proto = l4.proto,
	};
	__builtin_memcpy(rk.remote_ip, ip.daddr, 16);
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev6, &rk);
	if (!rv)
		return TC_ACT_OK;
	struct syn_info si = {
		.syn = l4.proto == IPPROTO_TCP && (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
		.seq = l4.tcp_seq,
	};
	if (si.syn)
		si.ts = tcp_tsval(skb, &l4);
	if (snat6_port_reusable(&rk, &si)) {
		bpf_map_delete_elem(&ct_rev6, &rk);
		return TC_ACT_OK;
	}
	count(DP_C_NAT66_HOST_HELD);
	return TC_ACT_SHOT;
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

/* guest -> fd63:7562:6500::5 (guest_ipv6 said V6_TO_HOST): as
 * guest_to_host, into the gateway device as sandbox_ipv6 -> the device's
 * IPv6 address; an echo reply (to the node's ping) with its addresses
 * only. */
__noinline int guest_to_host6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct ip6h ip;
	struct l4info l4;
	if (!sb || !pool6_on(c) || parse_ipv6(skb, &ip, &l4))
		return TC_ACT_SHOT;
	/* The proxy's ports take only what guest_to_proxy sends them (as
	 * from_guest's IPv4 check). */
	if (to_proxy_port(&l4)) {
		count(DP_C_POLICY_DROP);
		sb_count6(ifindex, DP_S_POLICY);
		return TC_ACT_SHOT;
	}
	struct dp_hflow_key hk = {};
	__u8 kind = DP_HF_GWDEV;
	int ports = l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP;
	__u16 fixed = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_HFF_GUEST_FIXED : 0;
	if (ports && guest_host_flow(skb, c, sb, &l4, DP_HFAM_IPV6, fixed, &hk, &kind))
		return TC_ACT_SHOT;
	if (kind != DP_HF_GWDEV) {
		/* Mapped ports through lo are IPv4's. */
		sb_count6(ifindex, DP_S_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	__u32 from[4], to[4];
	pool6_addr(from, c, sb->sandbox_ip);
	pool6_addr(to, c, c->host_ip);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip.saddr, from, &l4) ||
	    set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip.daddr, to, &l4))
		return TC_ACT_SHOT;
	if (ports && (set_port(skb, src_port_off(&l4), l4.sport, hk.dport, &l4) ||
		      set_port(skb, dst_port_off(&l4), l4.dport, hk.sport, &l4)))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}

/* guest_to_proxy's IPv6 twin: delivered as sandbox_ipv6 -> the gateway
 * device's IPv6 address:`pport`; the replies (host_to_sandbox6) come
 * from the address the guest dialled, to the guest address it sent from. */
static __always_inline int guest_to_proxy6(struct __sk_buff *skb, const struct dp_config *c,
					   const struct dp_sandbox *sb, const struct ip6h *ip,
					   const struct l4info *l4, __u16 pport)
{
	__u16 fixed = v6_fixed_eq(ip->saddr, DP_V6_GUEST_LO) ? DP_HFF_GUEST_FIXED : 0;
	int r = proxy_flow(skb, c, sb, l4, pport, DP_HFAM_IPV6, 0, ip->daddr, fixed);
	if (r)
		return r;
	__u32 from[4], to[4];
	pool6_addr(from, c, sb->sandbox_ip);
	pool6_addr(to, c, c->host_ip);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), ip->saddr, from, l4) ||
	    set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), ip->daddr, to, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, pport, l4))
		return TC_ACT_SHOT;
	return into_gwdev(skb, c);
}

/* guest -> the IPv6 world on port 53, 80 or 443 from a sandbox with
 * domain rules or in strict mode (guest_ipv6 said V6_STEER; from_guest's
 * tail call): steer_to_agent's IPv6 twin. DNS (UDP/TCP 53) to anyone goes
 * to the agent's resolver, with or without IPv6 egress; with DP_F_SNI,
 * TCP to 80/443 that no allowed CIDR covers goes to the proxy and UDP to
 * 443 is dropped. The agent's sockets are reached through the node's side
 * of host <-> sandbox over IPv6 (pool6): without it a flow they should
 * take is refused (an RST, so the client falls back to IPv4), never sent
 * on. Anything else goes on to guest6_out. */
SEC("classifier")
int guest6_steer(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct ip6h ip;
	struct l4info l4;
	if (!c || !sb)
		return TC_ACT_SHOT;
	if (parse_ipv6(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count6(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	/* The replies of a flow the world opened to a port mapping are the
	 * mapped service's, not the guest's requests (as IPv4's). */
	struct dp_ct6_key key = {
		.sandbox_ip = sb->sandbox_ip,
		.guest_port = l4.sport,
		.remote_port = l4.dport,
		.proto = l4.proto,
		.gaddr = v6_fixed_eq(ip.saddr, DP_V6_GUEST_LO) ? DP_GADDR_FIXED : DP_GADDR_SLAAC,
	};
	__builtin_memcpy(key.remote_ip, ip.daddr, 16);
	struct dp_ct_val *v = bpf_map_lookup_elem(&ct6, &key);
	int mapped = v && v->kind == DP_CT_PORTMAP && v->gen == sb->gen &&
		     portmap6_live(sb->sandbox_ip, v->nat_port, l4.proto, l4.sport);
	int router = v6_router(c, ifindex);
	__u16 pport = 0;
	if (mapped) {
	} else if ((sb->flags & DP_F_DOMAINS) && l4.dport == bpf_htons(53) &&
		   (l4.proto == IPPROTO_UDP || l4.proto == IPPROTO_TCP)) {
		pport = bpf_htons(53);
	} else if (router &&
		   (sb->flags & (DP_F_SNI | DP_F_INTERNET)) == (DP_F_SNI | DP_F_INTERNET)) {
		struct dp_policy6_key pk = {.prefixlen = 160, .sandbox_ip = sb->sandbox_ip};
		__builtin_memcpy(pk.dst, ip.daddr, 16);
		if (!bpf_map_lookup_elem(&policy6_allow, &pk)) {
			pport = proxy_port(sb, &l4);
			if (!pport && l4.proto == IPPROTO_UDP && l4.dport == bpf_htons(443)) {
				count(DP_C_POLICY_DROP);
				sb_count6(ifindex, DP_S_POLICY);
				return TC_ACT_SHOT; /* QUIC: clients fall back to TCP */
			}
		}
	}
	if (pport && pool6_on(c)) {
		int r = guest_to_proxy6(skb, c, sb, &ip, &l4, pport);
		if (r != PROXY_STALE)
			return r;
		count(DP_C_STALE_TCP);
		sb_count6(ifindex, DP_S_STALE_TCP);
		bpf_tail_call(skb, &tails, TAIL_GUEST6_RST);
		return TC_ACT_SHOT;
	}
	if (!pport && router)
		bpf_tail_call(skb, &tails, TAIL_GUEST6_OUT);
	return answer6(skb, V6_REFUSE);
}

/* host -> a sandbox's IPv6 identity (routed into the gateway device; to_
 * sandbox_ip's tail call: a program of its own, so that its stack is not
 * added to to_sandbox_ip's IPv4 one): only the node's own packets from the device's
 * address, TCP and UDP by host flow (the same admission as IPv4's: root
 * or host_access for a flow the node opens), echo requests of an admitted
 * sender; to the guest's address (the flow's, else its current one:
 * guest_fixed6) from fd63:7562:6500::5. */
SEC("classifier")
int host_to_sandbox6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c || !pool6_on(c))
		return TC_ACT_OK;
	struct l4info l4;
	__u32 dst;
	int from_device;
	{
		/* Scoped: the frame must fit to_sandbox_ip's in 512 bytes. */
		struct ip6h ip;
		if (parse_ipv6(skb, &ip, &l4) || ip.daddr[0] != c->pool6[0] ||
		    ip.daddr[1] != c->pool6[1] || ip.daddr[2] != c->pool6[2])
			return TC_ACT_OK;
		dst = ip.daddr[3];
		/* Only from the device's own address (another of the node's is
		 * not the flow's tuple). */
		from_device = ip.saddr[0] == c->pool6[0] && ip.saddr[1] == c->pool6[1] &&
			      ip.saddr[2] == c->pool6[2] && ip.saddr[3] == c->host_ip;
	}
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &dst);
	if (!tap)
		return TC_ACT_OK;
	if (skb->ingress_ifindex) {
		count(DP_C_FORWARDED_DROP);
		return TC_ACT_SHOT;
	}
	if (!from_device) {
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 tap_flags = tap->flags;
	struct dp_hflow_val *flow = NULL;
	if (l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP) {
		struct dp_hflow_key hk = {
			.saddr = c->host_ip,
			.daddr = dst,
			.sport = l4.sport,
			.dport = l4.dport,
			.proto = l4.proto,
			.family = DP_HFAM_IPV6,
		};
		/* As IPv4's: the agent's resolver and proxy answer only flows
		 * the address's current owner opened. */
		if (agent_service_port(&l4) && !hflow_of(c, &hk, dst, gen)) {
			count(DP_C_NO_ROUTE);
			return TC_ACT_SHOT;
		}
		__u16 gw_port;
		if (hflow_in(skb, c, &hk, dst, tap_ifindex, l4.dport, gen, DP_HF_GWDEV, 1, &l4,
			     &gw_port, &flow))
			return TC_ACT_SHOT;
		if (set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4))
			return TC_ACT_SHOT;
	} else if (!(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP6_ECHO_REQUEST) ||
		   !host_admitted(skb)) {
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	if (tap_flags & DP_T_PAUSED) {
		/* The sender: the gateway device's own IPv6 address. */
		struct dp_in6 from = {.w = {c->pool6[0], c->pool6[1], c->pool6[2], c->host_ip}};
		return paused_drop6(tap_ifindex, gen, dst, &from,
				    wake_what(l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
					      l4.proto == IPPROTO_ICMP ? 0 : l4.sport, l4.proto,
					      DP_WAKE_HOST));
	}
	__u32 old[4], a[4];
	pool6_addr(old, c, dst);
	/* To the guest address of the flow; a new one (or an echo) to the
	 * guest's current one. */
	int fixed = flow ? flow->flags & DP_HFF_GUEST_FIXED : guest_fixed6(tap_ifindex);
	v6_guest_addr(a, fixed ? DP_GADDR_FIXED : DP_GADDR_SLAAC, c);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, daddr), old, a, &l4))
		return TC_ACT_SHOT;
	pool6_addr(old, c, c->host_ip);
	/* A steered flow's replies come from the address the guest dialled. */
	if (flow && flow->kind == DP_HF_PROXY)
		__builtin_memcpy(a, flow->peer6, 16);
	else
		v6_fixed(a, DP_V6_GATEWAY_LO);
	if (set_addr6(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), old, a, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_TO_SANDBOX_IP);
	return to_guest6(skb, tap_ifindex);
}

/* Which of its two addresses the guest uses (sb_share.guest6), so that
 * flows others open to it go there (host <-> sandbox, port mappings): the
 * source of its IPv6 packets that may open something (all but TCP segments
 * after the SYN), or the target of its Duplicate Address
 * Detection (a guest configured statically claims fd63:7562:6500::6 at
 * link up, and may then stay silent until someone connects). Any other
 * source (link-local; a spoofed one, dropped further on) changes nothing,
 * and the entry is written only when it changes. A global function: its
 * stack is not from_guest's. */
__noinline int learn_guest6(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!skb || !c)
		return 0;
	/* A TCP segment other than a SYN is of a running flow: its address
	 * was learned when it opened (bulk data pays two byte loads, no map
	 * lookup). */
	__u8 nh, flags;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, nexthdr), &nh, 1))
		return 0;
	if (nh == IPPROTO_TCP &&
	    (bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(struct ip6h) + 13, &flags, 1) ||
	     (flags & 0x12) != 0x02))
		return 0;
	__u32 a[4];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + __builtin_offsetof(struct ip6h, saddr), a, 16))
		return 0;
	if (!(a[0] | a[1] | a[2] | a[3])) {
		/* From "::": a Neighbor Solicitation's target is the address
		 * claimed. */
		struct {
			__u8 type, code;
			__u16 csum;
			__u32 reserved;
			__u32 target[4];
		} ns;
		if (nh != IPPROTO_ICMPV6 ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(struct ip6h), &ns, sizeof(ns)) ||
		    ns.type != ND_NEIGHBOR_SOLICIT)
			return 0;
		__builtin_memcpy(a, ns.target, 16);
	}
	__u32 g;
	if (v6_fixed_eq(a, DP_V6_GUEST_LO))
		g = DP_SHARE_FIXED6;
	else if (v6_eui64_eq(a, DP_V6_PREFIX0, DP_V6_PREFIX1, c->guest_mac))
		g = 0;
	else
		return 0;
	__u32 ifindex = skb->ifindex;
	struct dp_share *s = bpf_map_lookup_elem(&sb_share, &ifindex);
	if (s && s->guest6 != g)
		s->guest6 = g;
	return 0;
}

SEC("classifier")
int from_guest(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_SHOT;
	__u32 ifindex = skb->ifindex;
	struct dp_sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	if (!sb)
		return TC_ACT_SHOT; /* an idle pool TAP: nothing leaves it */

	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth))) {
		count(DP_C_MALFORMED);
		sb_count(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (!mac_eq(eth.h_source, c->guest_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	if (eth.h_proto == bpf_htons(ETH_P_ARP))
		return proxy_arp(skb, c);
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		traffic6(ifindex, 0, skb->len);
		if (!(c->flags & DP_CFG_IPV6)) {
			sb_count6(ifindex, DP_S_UNSUPPORTED); /* ipv6 = "off" */
			return TC_ACT_SHOT;
		}
		learn_guest6(skb);
		int r = answer6(skb, V6_JUDGE);
		if (r == V6_TO_HOST)
			return guest_to_host6(skb);
		if (r == V6_STEER) {
			bpf_tail_call(skb, &tails, TAIL_GUEST6_STEER);
			return answer6(skb, V6_REFUSE); /* not loaded: refused */
		}
		if (r != V6_TO_WORLD)
			return r;
		bpf_tail_call(skb, &tails, TAIL_GUEST6_OUT);
		return answer6(skb, V6_REFUSE); /* not loaded: no egress */
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP)) {
		sb_count(ifindex, DP_S_UNSUPPORTED);
		return TC_ACT_SHOT;
	}
	/* Only the gateway is on the guest's link: no frame goes straight to
	 * another guest. */
	if (!mac_eq(eth.h_dest, c->gateway_mac)) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4)) {
		count(DP_C_MALFORMED);
		sb_count(ifindex, DP_S_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (ip.saddr != c->guest_ip) {
		count(DP_C_SPOOF_DROP);
		sb_count(ifindex, DP_S_SPOOFED);
		return TC_ACT_SHOT;
	}
	if (ip.daddr == c->gateway_ip) {
		/* The proxy's ports take only what guest_to_proxy sends them. */
		if (to_proxy_port(&l4)) {
			count(DP_C_POLICY_DROP);
			sb_count(ifindex, DP_S_POLICY);
			return TC_ACT_SHOT;
		}
		return guest_to_gateway(skb);
	}
	if (l4.proto == IPPROTO_ICMP &&
	    (l4.icmp_type == ICMP_DEST_UNREACH || l4.icmp_type == ICMP_TIME_EXCEEDED ||
	     l4.icmp_type == ICMP_PARAMETERPROB))
		return icmp_error_out(skb);
	return guest_to_world(skb, c, sb, &ip, &l4);
}

/* A reply to a host connection that to_uplink moved off a sandbox flow's
 * tuple gets its own port back; the host's stack takes it from there. */
static __always_inline int host_nat_reply(struct __sk_buff *skb, const struct dp_rev_key *rk,
					  const struct dp_rev_val *rv, const struct l4info *l4)
{
	struct dp_rev_key hk = {
		.remote_ip = rk->remote_ip,
		.remote_port = rk->remote_port,
		.nat_port = rv->guest_port,
		.proto = rk->proto,
	};
	struct dp_ct_val *hv = bpf_map_lookup_elem(&host_nat, &hk);
	if (!hv || hv->nat_port != rk->nat_port) {
		bpf_map_delete_elem(&ct_rev, rk);
		return TC_ACT_OK;
	}
	touch(hv, l4, DIR_IN);
	if (set_port(skb, dst_port_off(l4), rk->nat_port, hk.nat_port, l4))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* from_uplink's IPv4 part for a packet to the uplink's address: a reply
 * of a sandbox flow, a mapped flow, a fragment of either; TC_ACT_OK for
 * the host's own. */
static __always_inline int uplink_in(struct __sk_buff *skb, const struct dp_config *c,
				     struct iphdr *ip, struct l4info *l4)
{
	if (l4->frag) {
		int rc = frag_follow(skb, c, ip, l4);
		return rc < 0 ? TC_ACT_OK : rc;
	}
	if (l4->proto == IPPROTO_ICMP &&
	    (l4->icmp_type == ICMP_DEST_UNREACH || l4->icmp_type == ICMP_TIME_EXCEEDED ||
	     l4->icmp_type == ICMP_PARAMETERPROB))
		return icmp_error_in(skb);
	if (l4->proto != IPPROTO_TCP && l4->proto != IPPROTO_UDP &&
	    !(l4->proto == IPPROTO_ICMP && l4->icmp_type == ICMP_ECHOREPLY))
		return TC_ACT_OK;

	__u32 sandbox_ip;
	__u16 guest_port;
	struct dp_tap *tap;
	struct dp_rev_key rk = {
		.remote_ip = ip->saddr,
		.remote_port = l4->proto == IPPROTO_ICMP ? 0 : l4->sport,
		.nat_port = l4->dport,
		.proto = l4->proto,
	};
	struct dp_rev_val *rv = bpf_map_lookup_elem(&ct_rev, &rk);
	if (rv && rv->sandbox_ip == 0)
		return host_nat_reply(skb, &rk, rv, l4);
	if (rv) {
		sandbox_ip = rv->sandbox_ip;
		guest_port = rv->guest_port;
		__u64 gen = rv->gen;
		struct dp_ct_key key = {
			.sandbox_ip = sandbox_ip,
			.remote_ip = ip->saddr,
			.guest_port = guest_port,
			.remote_port = rk.remote_port,
			.proto = l4->proto,
		};
		struct dp_ct_val *v = bpf_map_lookup_elem(&ct, &key);
		if (!v || v->gen != gen || v->nat_port != rk.nat_port || v->kind != DP_CT_SNAT) {
			/* The forward entry was reaped (or is another flow's
			 * now): the flow is over. */
			bpf_map_delete_elem(&ct_rev, &rk);
			return TC_ACT_OK;
		}
		tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
		if (!tap || tap->gen != gen) {
			/* The flow of a released sandbox, or of an earlier owner
			 * of this address: never delivered to the new owner. */
			drop_stale(&key, v);
			return TC_ACT_OK;
		}
		/* A live sandbox flow owns its tuple: no host socket can take
		 * its replies (to_uplink moves a host connection that would
		 * use the same tuple to another port). */
		touch(v, l4, DIR_IN);
		count(DP_C_SNAT_REPLY);
	} else {
		if (l4->proto == IPPROTO_ICMP)
			return TC_ACT_OK;
		/* daddr is the uplink address: the mapping on exactly it, or on
		 * every node address. Loopback mappings never match here. */
		struct dp_portmap_val *pm = find_portmap(ip->daddr, l4->dport, l4->proto, 1);
		if (!pm)
			return TC_ACT_OK; /* the host's own traffic */
		sandbox_ip = pm->sandbox_ip;
		guest_port = pm->container_port;
		tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
		if (!tap)
			return TC_ACT_SHOT;
		struct dp_ct_key key = {
			.sandbox_ip = sandbox_ip,
			.remote_ip = ip->saddr,
			.guest_port = guest_port,
			.remote_port = l4->sport,
			.proto = l4->proto,
		};
		struct dp_ct_val *v = flow_of(&key, tap->gen);
		if (opens_flow(v, l4) && !(pm->flags & DP_PM_WINS) &&
		    host_socket(skb, l4->proto, ip->saddr, l4->sport, ip->daddr, l4->dport, 1)) {
			/* A host socket listens on (or is bound to) this port: the
			 * host wins for new flows; mapped flows already running
			 * keep going. */
			if (v)
				bpf_map_delete_elem(&ct, &key);
			count(DP_C_PORTMAP_HOST_SOCKET);
			return TC_ACT_OK;
		}
		if (v) {
			touch(v, l4, DIR_IN);
		} else {
			struct dp_ct_val nv = {.nat_port = l4->dport, .kind = DP_CT_PORTMAP,
					       .gen = tap->gen};
			touch(&nv, l4, DIR_IN);
			bpf_map_update_elem(&ct, &key, &nv, BPF_ANY);
			sb_count(tap->ifindex, DP_S_NEW_PORTMAP);
		}
		count(DP_C_PORTMAP);
	}
	__u32 tap_ifindex = tap->ifindex;
	if (tap->flags & DP_T_PAUSED)
		return paused_drop(tap_ifindex, tap->gen, sandbox_ip, ip->saddr,
				   wake_what(guest_port, rk.remote_port, l4->proto,
					     rv ? DP_WAKE_REPLY : DP_WAKE_PORTMAP));
	if (tap->flags & DP_T_SHAPE_IN)
		skb->priority = skb->len <= DP_SHAPE_SMALL ? DP_TAP_CLASS_SMALL : DP_TAP_CLASS_BULK;
	if (l4->first_frag)
		frag_note(ip, tap_ifindex, tap->gen, ip->saddr, c->guest_ip);
	if (set_addr(skb, IP_DST_OFF, ip->daddr, c->guest_ip, l4) ||
	    set_port(skb, dst_port_off(l4), l4->dport, guest_port, l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	return bpf_redirect(tap_ifindex, 0);
}

SEC("classifier")
int from_uplink(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		/* A sandbox identity or the guests' link as the source: forged
		 * (the node would answer it into the sandbox as its own). */
		if (forged6(skb))
			return TC_ACT_SHOT;
		if (c->flags & DP_CFG_IPV6_EGRESS)
			bpf_tail_call(skb, &tails, TAIL_UPLINK6_IN);
		return TC_ACT_OK;
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	int hairpin = skb->mark == DP_HAIRPIN_MARK;
	if (hairpin) {
		skb->mark = 0;
	} else if (sandbox_source(c, ip.saddr)) {
		count(DP_C_FORGED_SOURCE);
		return TC_ACT_SHOT;
	}
	if (!c->uplink_ip || ip.daddr != c->uplink_ip)
		return hairpin ? TC_ACT_SHOT : TC_ACT_OK;
	int rc = uplink_in(skb, c, &ip, &l4);
	if (hairpin && rc == TC_ACT_OK) {
		/* Not a mapped flow or its reply: never the host's. */
		count(DP_C_NODE_ADDR);
		return TC_ACT_SHOT;
	}
	return rc;
}

/* Ingress of the shaper device's peer: a limited sandbox's packet to the
 * world, translated by from_guest and released by its HTB class, goes on
 * out of the uplink. Nothing else is accepted here. */
SEC("classifier")
int from_shaper(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_SHOT;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_SHOT;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6) && (c->flags & DP_CFG_IPV6_EGRESS)) {
		struct ip6h ip6;
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) ||
		    !v6_eq(ip6.saddr, c->uplink_ip6))
			return TC_ACT_SHOT;
		skb->priority = 0;
		return forward_out6(skb, c, ip6.daddr, ip6.nexthdr);
	}
	if (!c->uplink_ip || eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_SHOT;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4) || ip.saddr != c->uplink_ip)
		return TC_ACT_SHOT;
	skb->priority = 0;
	return forward_out(skb, c, ip.daddr, ip.tos, ip.protocol);
}

/* host -> sandbox IP (routed into the gateway device): to the guest, from
 * the gateway, with a gateway-side port of its own (hflow). */
SEC("classifier")
int to_sandbox_ip(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		bpf_tail_call(skb, &tails, TAIL_HOST_TO_SANDBOX6);
		return TC_ACT_OK; /* not loaded: no host <-> sandbox over IPv6 */
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	__u32 dst = ip.daddr;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &dst);
	if (!tap)
		return TC_ACT_OK;
	/* Only the node's own packets reach a sandbox here: one the node
	 * forwards (a container's, a neighbour's with a route to the pool)
	 * came in on some device. */
	if (skb->ingress_ifindex) {
		count(DP_C_FORWARDED_DROP);
		return TC_ACT_SHOT;
	}
	if (l4.frag) {
		int rc = frag_follow(skb, c, &ip, &l4);
		return rc < 0 ? TC_ACT_SHOT : rc;
	}
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 peer = 0;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP && !host_admitted(skb)) {
		/* ICMP has no flows: every packet is judged (the kernel's own
		 * errors are root's). */
		count(DP_C_HOST_DENIED);
		return TC_ACT_SHOT;
	}
	if (l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP) {
		struct dp_hflow_key hk = {
			.saddr = ip.saddr,
			.daddr = ip.daddr,
			.sport = l4.sport,
			.dport = l4.dport,
			.proto = l4.proto,
		};
		/* The agent's own services (resolver, proxy) answer flows the
		 * guest opened: with no such flow (a released sandbox's, whose
		 * address may have a new owner) the packet goes nowhere. */
		if (ip.saddr == c->host_ip && agent_service_port(&l4) &&
		    !hflow_of(c, &hk, dst, gen)) {
			count(DP_C_NO_ROUTE);
			return TC_ACT_SHOT;
		}
		/* A flow the node opens needs host access (a reply to a flow
		 * the guest opened has its entry). */
		__u16 gw_port;
		struct dp_hflow_val *flow;
		if (hflow_in(skb, c, &hk, dst, tap_ifindex, l4.dport, gen, DP_HF_GWDEV, 1, &l4,
			     &gw_port, &flow))
			return TC_ACT_SHOT;
		if (flow && flow->kind == DP_HF_PROXY)
			peer = flow->peer_ip;
		if (set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4))
			return TC_ACT_SHOT;
	}
	if (tap->flags & DP_T_PAUSED)
		return paused_drop(tap_ifindex, gen, dst, ip.saddr,
				   wake_what(l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
					     l4.proto == IPPROTO_ICMP ? 0 : l4.sport, l4.proto,
					     DP_WAKE_HOST));
	if (l4.first_frag)
		frag_note(&ip, tap_ifindex, gen, peer ? peer : c->gateway_ip, c->guest_ip);
	/* A proxied flow's replies come from the address the guest dialled. */
	if (set_addr(skb, IP_DST_OFF, ip.daddr, c->guest_ip, &l4) ||
	    set_addr(skb, IP_SRC_OFF, ip.saddr, peer ? peer : c->gateway_ip, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_TO_SANDBOX_IP);
	return bpf_redirect(tap_ifindex, 0);
}

SEC("classifier")
int from_host(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	/* A node process sending from a sandbox identity (IP_FREEBIND and
	 * IPV6_FREEBIND need no capability): only the datapath delivers such
	 * sources (into the gateway device, never through lo), so the agent's
	 * resolver and proxy, the node's services and the kernel's answers
	 * never take a local user for a sandbox. */
	if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
		if (forged6(skb))
			return TC_ACT_SHOT;
		return TC_ACT_OK;
	}
	if (eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4))
		return TC_ACT_OK;
	if (sandbox_source(c, ip.saddr)) {
		count(DP_C_FORGED_SOURCE);
		return TC_ACT_SHOT;
	}
	if (l4.frag || l4.first_frag || (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP))
		return TC_ACT_OK;
	/* Everything leaving through lo is addressed to the node itself. A
	 * mapping on exactly the destination address matches; a wildcard one
	 * only for 127.0.0.0/8 (first byte in network order) and the uplink
	 * address. */
	int wildcard = (ip.daddr & 0xff) == 127 || (c->uplink_ip && ip.daddr == c->uplink_ip);
	struct dp_portmap_val *pm = find_portmap(ip.daddr, l4.dport, l4.proto, wildcard);
	if (!pm)
		return TC_ACT_OK;
	__u32 sandbox_ip = pm->sandbox_ip;
	__u16 container_port = pm->container_port;
	int wins = pm->flags & DP_PM_WINS;
	struct dp_tap *tap = bpf_map_lookup_elem(&by_ip, &sandbox_ip);
	if (!tap)
		return TC_ACT_OK;
	__u32 tap_ifindex = tap->ifindex;
	__u64 gen = tap->gen;
	__u32 tap_flags = tap->flags;
	struct dp_hflow_key hk = {
		.saddr = ip.saddr,
		.daddr = ip.daddr,
		.sport = l4.sport,
		.dport = l4.dport,
		.proto = l4.proto,
	};
	struct dp_hflow_val *hv = hflow_of(c, &hk, sandbox_ip, gen);
	int opens = !hv || (l4.proto == IPPROTO_TCP &&
			    (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN);
	if (opens && !wins &&
	    host_socket(skb, l4.proto, ip.saddr, l4.sport, ip.daddr, l4.dport, 1)) {
		/* A host socket listens there: the host wins (new flows). */
		if (hv)
			hflow_drop(c, &hk, hv);
		count(DP_C_PORTMAP_HOST_SOCKET);
		return TC_ACT_OK;
	}
	/* A port mapping is open to every local process (as one on a node
	 * address is to the world): no host-access check, the share only. */
	__u16 gw_port;
	struct dp_hflow_val *flow;
	if (hflow_in(skb, c, &hk, sandbox_ip, tap_ifindex, container_port, gen, DP_HF_LO, 0, &l4,
		     &gw_port, &flow))
		return TC_ACT_SHOT;
	if (tap_flags & DP_T_PAUSED)
		return paused_drop(tap_ifindex, gen, sandbox_ip, ip.saddr,
				   wake_what(container_port, l4.sport, l4.proto, DP_WAKE_HOST));
	if (set_addr(skb, IP_DST_OFF, ip.daddr, c->guest_ip, &l4) ||
	    set_addr(skb, IP_SRC_OFF, ip.saddr, c->gateway_ip, &l4) ||
	    set_port(skb, dst_port_off(&l4), l4.dport, container_port, &l4) ||
	    set_port(skb, src_port_off(&l4), l4.sport, gw_port, &l4) ||
	    set_macs(skb, c->guest_mac, c->gateway_mac))
		return TC_ACT_SHOT;
	count(DP_C_LOCAL);
	return bpf_redirect(tap_ifindex, 0);
}

/* The host's own traffic leaving the uplink (and what the host forwards,
 * e.g. netfilter-masqueraded containers): a connection whose source port
 * lies in the SNAT range takes its tuple in the same space as sandbox
 * flows (ct_rev), so a sandbox never gets its replies; if a live sandbox
 * flow holds the tuple already, the host connection leaves with another
 * port of the range instead (and from_uplink gives its replies their port
 * back), as conntrack does for clashing connections. Sandbox packets
 * (redirected here by from_guest, already translated) pass untouched. */
static __always_inline int uplink_out(struct __sk_buff *skb)
{
	struct dp_config *c = get_config();
	if (!c)
		return TC_ACT_OK;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return TC_ACT_OK;
	if (eth.h_proto == bpf_htons(ETH_P_IPV6))
		return (c->flags & DP_CFG_IPV6_EGRESS) ? to_uplink6(skb) : TC_ACT_OK;
	if (!c->uplink_ip || eth.h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr ip;
	struct l4info l4;
	if (parse_ipv4(skb, &ip, &l4) || l4.frag || ip.saddr != c->uplink_ip)
		return TC_ACT_OK;
	if (l4.proto != IPPROTO_TCP && l4.proto != IPPROTO_UDP &&
	    !(l4.proto == IPPROTO_ICMP && l4.icmp_type == ICMP_ECHO))
		return TC_ACT_OK;
	__u16 port = bpf_ntohs(l4.sport);
	if (port < c->snat_port_min || port > c->snat_port_max)
		return TC_ACT_OK;
	__u32 iif = skb->ingress_ifindex;
	if (iif && (iif == c->shaper_peer_ifindex || bpf_map_lookup_elem(&sandboxes, &iif)))
		return TC_ACT_OK;
	struct dp_rev_key hk = {
		.remote_ip = ip.daddr,
		.remote_port = l4.proto == IPPROTO_ICMP ? 0 : l4.dport,
		.nat_port = l4.sport,
		.proto = l4.proto,
	};
	__u16 out;
	struct dp_ct_val *hv = bpf_map_lookup_elem(&host_nat, &hk);
	if (hv) {
		touch(hv, &l4, DIR_OUT);
		out = hv->nat_port;
	} else {
		struct dp_rev_val rv = {.sandbox_ip = 0, .guest_port = l4.sport, .gen = 0};
		struct syn_info si = {
			.syn = l4.proto == IPPROTO_TCP &&
			       (l4.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN,
			.seq = l4.tcp_seq,
		};
		if (si.syn)
			si.ts = tcp_tsval(skb, &l4);
		if (bpf_map_update_elem(&ct_rev, &hk, &rv, BPF_NOEXIST) == 0 ||
		    (snat_port_reusable(&hk, &si) &&
		     bpf_map_update_elem(&ct_rev, &hk, &rv, BPF_ANY) == 0)) {
			out = l4.sport;
		} else if (host_tuple_alloc(skb, &hk, port + ip.daddr * 2654435761u, &si, &out)) {
			/* The whole range is held to this remote endpoint: the
			 * connection keeps its port (as before this program). */
			return TC_ACT_OK;
		} else {
			count(DP_C_HOST_REMAP);
		}
		struct dp_ct_val nv = {.nat_port = out, .kind = DP_CT_HOST};
		touch(&nv, &l4, DIR_OUT);
		bpf_map_update_elem(&host_nat, &hk, &nv, BPF_ANY);
	}
	if (out != l4.sport && set_port(skb, src_port_off(&l4), l4.sport, out, &l4))
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* The uplink's egress: the host's own connections as above; then a
 * packet of the agent's own socket that carries a limited sandbox's
 * traffic to the world (strict mode's proxy) names the sandbox's class of
 * the shaper in its priority (only CAP_NET_ADMIN sets such a priority):
 * it goes through the shaper, whose peer (from_shaper, which clears the
 * priority) sends it on out of here. */
SEC("classifier")
int to_uplink(struct __sk_buff *skb)
{
	int rc = uplink_out(skb);
	if (rc == TC_ACT_OK && (skb->priority >> 16) == (DP_TAP_CLASS_BULK >> 16)) {
		struct dp_config *c = get_config();
		if (c && c->shaper_ifindex && skb->protocol == bpf_htons(ETH_P_IP))
			return bpf_redirect(c->shaper_ifindex, 0);
	}
	return rc;
}
