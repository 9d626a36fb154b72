// SPDX-License-Identifier: GPL-2.0
/* Every map of the datapath, in one place (pinned by name; the Rust side's
 * twins are in src/datapath/maps.rs), and the tail-call slots (tails).
 * Part of datapath.bpf.c's one translation unit (see there). */

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

/* The flow log: an ended flow's totals on their way into its DP_FE_END
 * event (per CPU: within one program run). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct dp_flow_totals);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} flow_scratch SEC(".maps");

/* The flow log's events (lib/flow_log.h), read by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, DP_FLOW_EVENTS_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} flow_events SEC(".maps");
