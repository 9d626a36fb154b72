/* SPDX-License-Identifier: GPL-2.0 */
/* Map key/value layouts shared with src/datapath/maps.rs (#[repr(C)]).
 * Every struct is padded explicitly; the Rust side asserts the sizes.
 * Addresses and ports are in network byte order unless noted. */
#ifndef CUBE_DATAPATH_H
#define CUBE_DATAPATH_H

#include <linux/types.h>

struct dp_config {
	__u32 guest_ip;        /* 169.254.68.6 */
	__u32 gateway_ip;      /* 169.254.68.5, what guests route through */
	__u32 host_ip;         /* the gateway device's address (pool .1) */
	__u32 uplink_ip;       /* SNAT address; 0 = no egress */
	__u32 uplink_ifindex;
	__u32 gwdev_ifindex;   /* cube-dev */
	__u16 snat_port_min;   /* host order */
	__u16 snat_port_max;   /* host order */
	__u8 guest_mac[6];
	__u8 gateway_mac[6];
	__u8 gwdev_mac[6];
	__u16 pad;
	/* Host <-> sandbox flows (hflow) per sandbox: every sandbox may hold
	 * `hflow_guaranteed` whatever the others do (all of them at that many
	 * fit half the map); beyond, up to `hflow_cap`, from a pool of
	 * `hflow_borrow` entries shared by all (the other half). */
	__u32 hflow_guaranteed;
	__u32 hflow_cap;
	__u32 hflow_borrow;
	/* The shaper device (egress limits: HTB at its root; its peer's
	 * ingress runs from_shaper, which sends packets on out of the
	 * uplink); 0 = none. */
	__u32 shaper_ifindex;
	__u32 shaper_peer_ifindex;
	__u32 flags;           /* DP_CFG_*; was padding (0) in older builds */
	/* NAT66: the uplink's global IPv6 address (DP_CFG_IPV6_EGRESS). */
	__u32 uplink_ip6[4];
	/* Host <-> sandbox over IPv6: the /96 of the sandboxes' IPv6
	 * identities (sandbox_ipv6 = pool6 ‖ sandbox_ip; the gateway device's
	 * address pool6 ‖ host_ip); all 0 = none. */
	__u32 pool6[3];
	/* The pool's netmask (network order): host_ip & pool_mask is the
	 * sandboxes' IPv4 network; 0 = none (builds before wrote no field). */
	__u32 pool_mask;
	/* The flow log (DP_CFG_FLOW_EVENTS): a sandbox emits one event every
	 * flow_interval_ns on average, flow_burst at once. */
	__u32 flow_interval_ns;
	__u32 flow_burst;
}; /* 112 bytes */

/* skb->mark of a sandbox's packet to a port mapping at the node's own
 * address, turned around into the uplink's ingress (forward_out): from_uplink
 * takes it as a hairpin (a mapped flow or its reply), never as the host's. */
#define DP_HAIRPIN_MARK 0x63756265u
/* Entries of node_addrs and node_addrs6. */
#define DP_NODE_ADDRS_MAX 4096

/* dp_config.flags */
#define DP_CFG_IPV6 1 /* the guests' IPv6 link (RA, NA, refusals); else IPv6 is dropped */
/* The uplink has a global IPv6 address (uplink_ip6) and an IPv6 default
 * route: sandboxes with DP_F_V6_OUT reach the world over IPv6 (NAT66). */
#define DP_CFG_IPV6_EGRESS 2
/* The flow log: flows' first packets and refusals go to flow_events. */
#define DP_CFG_FLOW_EVENTS 4
/* deny_action "reject": a refused TCP SYN gets an RST, anything else an
 * ICMP/ICMPv6 administratively prohibited, from the gateway. */
#define DP_CFG_REJECT 8

/* A flow event (the flow_events ring; docs/flows.md): a flow's first
 * packet forwarded, or a packet refused. Addresses in network order, v4
 * in the first word; ports in network order. */
struct dp_flow_event {
	__u64 ts_ns;           /* bpf_ktime_get_ns */
	__u64 gen;             /* the sandbox owner's generation */
	__u32 ifindex;         /* the sandbox's TAP or veth */
	__u32 sandbox_ip;
	__u8 kind;             /* DP_FE_* */
	__u8 reason;           /* DP_FE_REFUSED: DP_FR_* */
	__u8 dir;              /* DP_FD_* */
	__u8 family;           /* 4 or 6 */
	__u8 proto;
	__u8 via;              /* DP_FV_* */
	__u16 node_port;
	__u16 guest_port;
	__u16 remote_port;
	__u32 guest_ip[4];
	__u32 remote_ip[4];
	__u32 node_ip[4];      /* all 0: none */
	__u32 pad;
	/* DP_FE_END: the flow's totals (struct dp_flow_totals). */
	__u64 start_ns;
	__u64 bytes_out;
	__u64 bytes_in;
	__u32 pkts_out;
	__u32 pkts_in;
}; /* 120 bytes */
/* A flow's totals as a DP_FE_END event carries them (flow_scratch: the
 * ended flow's, handed from flow_reopen to flow_note). */
struct dp_flow_totals {
	__u64 start_ns;
	__u64 bytes_out;
	__u64 bytes_in;
	__u32 pkts_out;
	__u32 pkts_in;
}; /* 32 bytes */
#define DP_FE_START 1
#define DP_FE_REFUSED 2
/* A flow's end the datapath saw: a SYN reopened its closed tuple before
 * the reaper saw it closed (the reaper records every other end). */
#define DP_FE_END 3
#define DP_FD_EGRESS 0   /* the sandbox to the world */
#define DP_FD_INGRESS 1  /* the world to a port mapping */
#define DP_FD_HOST 2     /* the node and the sandbox */
#define DP_FV_NONE 0
#define DP_FV_SNAT 1     /* egress through SNAT or NAT66 */
#define DP_FV_PORTMAP 2  /* a port mapping */
#define DP_FV_FROM_NODE 3 /* the node opened it (to the sandbox address or a mapped port) */
#define DP_FV_TO_GATEWAY 4 /* the guest opened it to its gateway (resolver, proxy) */
#define DP_FR_POLICY 1
#define DP_FR_UNLEARNED 2
#define DP_FR_NODE_ADDR 3
#define DP_FR_SPOOFED 4
#define DP_FR_PAUSED 5
#define DP_FR_STALE_TCP 6
#define DP_FR_NO_PORT 7
#define DP_FR_NO_ROUTE 8
#define DP_FR_UNSUPPORTED 9
#define DP_FR_MALFORMED 10
#define DP_FLOW_EVENTS_BYTES (2 * 1024 * 1024)

/* The guests' IPv6 link (docs/dual-stack.md): the same on every TAP and
 * node, so a snapshot restores anywhere. The guest's addresses are
 * fd63:7562:6500::6 (static), the prefix's modified EUI-64 of the guest
 * MAC (SLAAC) and fe80:: with the same interface id; the gateway answers
 * as the link-local address of the gateway MAC and fd63:7562:6500::5. */
#define DP_V6_PREFIX0 0xfd637562 /* fd63:7562:6500::/64, first word (host order) */
#define DP_V6_PREFIX1 0x65000000
#define DP_V6_GUEST_LO 6  /* ::6 */
#define DP_V6_GATEWAY_LO 5 /* ::5 */

/* A sandbox's share of the node-wide tables (sb_share, keyed by the TAP or
 * veth ifindex, like sb_stats): entries it holds now. */
struct dp_share {
	/* Two budgets (DP_SHARE_*): the low 16 bits count the flows the guest
	 * opened (to its gateway, the agent's resolver and proxy), the high 16
	 * the flows others opened to it (the node's to its address, any local
	 * process's through a mapping on lo), each with half of the
	 * guaranteed entries and half of the cap (hflow_cap <= 4096): a flood
	 * of either never takes the other's room. Builds before counted all
	 * in one (the reaper's recount splits them). */
	__u32 hflow;
	/* DP_SHARE_FIXED6: the guest's IPv6 address is fd63:7562:6500::6, not
	 * its SLAAC address (0, also before it was seen): the last of the
	 * two it sent from or claimed (Duplicate Address Detection). Written
	 * by the datapath (learn_guest6); flows others open to the guest go
	 * there. "pad" (always 0) in builds before. */
	__u32 guest6;
}; /* 8 bytes */
#define DP_SHARE_FIXED6 1u
/* The node-wide side (share_pool, one entry): entries held beyond the
 * guaranteed ones. */
struct dp_share_pool {
	__u32 hflow_borrowed;
	/* Of those, the ones flows others opened hold: each budget borrows
	 * at most half the pool, so flooding many sandboxes' mappings on lo
	 * never leaves the guests' own flows only their guaranteed entries.
	 * "pad" (0) in builds before (the reaper's recount sets it). */
	__u32 hflow_borrowed_in;
}; /* 8 bytes */

/* Generations: every owner of a sandbox address gets a generation of its
 * own (written by the agent when an address is attached with no `by_ip`
 * entry, kept by every later attach of the same owner; unique per boot,
 * which is as long as pinned maps live). Each flow records the generation
 * of the owner that created it; a lookup that finds a flow of another
 * generation treats it as no flow and deletes it, so a released sandbox's
 * flows never reach the next owner of its address, and release does not
 * have to walk the flow maps (the reaper removes them later). */

/* TAP ifindex -> sandbox */
struct dp_sandbox {
	__u32 sandbox_ip;
	__u32 flags;           /* DP_F_* */
	__u64 gen;             /* the owner's generation (as in by_ip) */
}; /* 16 bytes */
#define DP_F_INTERNET 1u
/* The sandbox has domain rules (docs/egress.md): a new flow may also go to
 * an address the agent's resolver learned for it (dns_learned), and DNS
 * or DNS-over-TLS to anyone but the gateway is dropped. */
#define DP_F_DOMAINS 2u
/* Strict egress (egress_mode "sni", docs/egress.md): the sandbox's new TCP
 * flows to ports 80 and 443 that no allowed CIDR covers go to the agent's
 * proxy (gateway-device address, DP_PROXY_*_PORT), which reads the TLS
 * ClientHello or the HTTP Host and dials the name itself; UDP to 443
 * (QUIC) is dropped so clients fall back to TCP. */
#define DP_F_SNI 4u
/* Egress rules (egress_rules, docs/egress.md "Egress rules"): every new
 * TCP flow to ports 80 and 443 that the policy lets out goes to the
 * agent's proxy, which intercepts a rule's host and splices any other to
 * the address the guest dialled. UDP is untouched. */
#define DP_F_RULES 64u
/* The sandbox's traffic to the world is shaped (sb_rate, DP_SHAPE_*). */
#define DP_F_SHAPE_OUT 8u
/* The sandbox's IPv6 reaches the world (NAT66) when the node has IPv6
 * egress: written for sandboxes whose policy is the internet under rules
 * that leave some IPv6 open (not strict; docs/dual-stack.md). Others get
 * their IPv6 refused at once. */
#define DP_F_V6_OUT 16u
/* The sandbox has IPv6 policy entries (policy6_allow / policy6_deny: an
 * IPv6 CIDR of its allow_out or deny_out, or the catch-all deny): its
 * IPv6 egress is judged by policy6_allows, not by the default denies
 * alone. */
#define DP_F_V6_RULES 32u
/* Below 1024, so that only a privileged process can bind them (a local
 * user could otherwise take them while the agent is down, and the
 * datapath would hand it the sandboxes' flows); 1021 and 1022 are the
 * ports RFC 3692 sets aside for experiments, which no service claims. */
#define DP_PROXY_TLS_PORT 1021  /* host order */
#define DP_PROXY_HTTP_PORT 1022 /* host order */

/* (sandbox ip, destination) -> until when a new flow may start: written
 * by the agent's resolver before it answers. A flow that started keeps
 * going after expiry as long as the entry exists (the agent removes it
 * when the name is no longer allowed; release changes the generation). */
struct dp_learned_key {
	__u32 sandbox_ip;
	__u32 dst;
}; /* 8 bytes */
struct dp_learned_val {
	__u64 expires_ns;      /* CLOCK_MONOTONIC (bpf_ktime_get_ns) */
	__u64 gen;             /* the owner's generation when learned */
}; /* 16 bytes */
#define DP_LEARNED_MAX 1048576 /* 10,000 sandboxes x 100 */
/* The IPv6 twin (dns_learned6: AAAA answers), same values; the agent's
 * per-sandbox cap counts both families together. */
struct dp_learned6_key {
	__u32 sandbox_ip;
	__u8 dst[16];
}; /* 20 bytes */
#define DP_HFLOW_MAX 262144    /* hflow and hrev: never evicted, shared by shares */

/* sandbox ip -> TAP */
struct dp_tap {
	__u32 ifindex;
	__u32 flags;           /* DP_T_* (0 in builds before bandwidth limits) */
	__u64 gen;             /* the owner's generation */
}; /* 16 bytes */
/* What comes from the world to the sandbox is shaped (DP_TAP_CLASS_*). */
#define DP_T_SHAPE_IN 1u
/* The sandbox's VM is paused (EnsureNetwork `paused`): packets for it are
 * dropped, and the first one of each pause is reported (dp_wake). */
#define DP_T_PAUSED 2u

/* The first packet for a paused sandbox, as reported to the agent (the
 * `wakes` ring buffer) and kept in `wake_sent` (keyed by the TAP/veth
 * ifindex) until the agent arms the next pause: at most one per pause. */
struct dp_wake {
	__u64 gen;             /* the owner's generation */
	__u32 sandbox_ip;
	__u32 ifindex;
	__u32 remote_ip;       /* who sent it: a world address, or the host's */
	__u16 port;            /* the sandbox's port it was for (ICMP: 0) */
	__u16 remote_port;
	__u8 proto;
	__u8 kind;             /* DP_WAKE_* */
	__u8 pad[6];
}; /* 32 bytes */
/* The ring's record of a report whose sender has an IPv6 address: the
 * same first 32 bytes (remote_ip 0), then the address (network order).
 * wake_sent keeps the first 32. The reader tells them by their length. */
struct dp_wake6 {
	struct dp_wake w;
	__u32 remote_ip6[4];
}; /* 48 bytes */
#define DP_WAKE_REPLY 0    /* a reply to a flow the sandbox opened */
#define DP_WAKE_PORTMAP 1  /* a new or running flow to a port mapping */
#define DP_WAKE_HOST 2     /* the node: to the sandbox address, or a mapped port via lo */
#define DP_WAKES_BYTES (256 * 1024)

/* Bandwidth limits (docs/datapath.md "Bandwidth") are shaped by HTB
 * qdiscs the agent keeps, one class tree per limited sandbox: a parent at
 * the limit and two leaves under it, "small" (packets of at most
 * DP_SHAPE_SMALL bytes: pings, pure ACKs, DNS; served first) and "bulk".
 * The programs only pick the class, by setting skb->priority to its id
 * (HTB takes a packet whose priority names one of its leaves): world ->
 * sandbox on the sandbox's own device (fixed ids, DP_TAP_CLASS_*);
 * sandbox -> world on the shaper device (ids of the sandbox's own, in
 * sb_rate), whose peer hands the packets on to the uplink: the uplink's
 * own qdisc and the traffic of every unlimited sandbox never meet a
 * shaper. */
#define DP_SHAPE_SMALL 256
#define DP_TAP_CLASS_SMALL 0xc0be0002u
#define DP_TAP_CLASS_BULK 0xc0be0003u
struct dp_rate {
	__u32 out_small;       /* the uplink's class ids of the sandbox (0: */
	__u32 out_bulk;        /* no egress limit) */
	__u32 in_shaped;       /* (the agent's) 1: the device has a shaper */
	__u32 pad;
}; /* 16 bytes */

/* policy tries: 64-bit key = sandbox ip (32 bits) + destination prefix.
 * policy_allow values are 1. policy_deny values say whether an address
 * the resolver learned for the sandbox passes the deny: only the
 * catch-all 0.0.0.0/0 ("anything not allowed otherwise") lets it; every
 * narrower deny CIDR beats it. Builds before this distinction wrote 1. */
#define DP_DENY_CATCH_ALL 1
#define DP_DENY_BEATS_LEARNED 2
struct dp_policy_key {
	__u32 prefixlen;       /* 32 + CIDR length */
	__u32 sandbox_ip;
	__u32 dst;
}; /* 12 bytes */
/* The IPv6 twin (policy6_allow / policy6_deny): 160-bit key, same values;
 * the deny catch-all is ::/0 (written for 0.0.0.0/0 too: "anything not
 * allowed" covers both families, and ::/0 covers IPv4's). */
struct dp_policy6_key {
	__u32 prefixlen;       /* 32 + CIDR length */
	__u32 sandbox_ip;
	__u8 dst[16];
}; /* 24 bytes */

/* (host address, protocol, host port) -> (sandbox, container port).
 * host_ip 0 is the wildcard (0.0.0.0 / ""): the uplink address and
 * 127.0.0.0/8; any other value matches only that destination address.
 * Lookups try the exact address first, then the wildcard. */
struct dp_portmap_key {
	__u32 host_ip;
	__u16 host_port;
	__u8 proto;
	__u8 pad;
}; /* 8 bytes */
struct dp_portmap_val {
	__u32 sandbox_ip;
	__u16 container_port;
	__u16 flags;           /* DP_PM_* ("pad", always 0, in builds before) */
}; /* 8 bytes */
/* A mapping on the node's IPv6 address only (host_ip "::" or the uplink's
 * IPv6 address; key host_ip 0): IPv4's lookups (find_portmap) pass it by. */
#define DP_PM_V6_ONLY 1
/* The mapping wins over host sockets on its port (the CNI front end: a
 * runtime such as podman holds the published port itself after ADD, and
 * expects portmap's order, DNAT before any socket); without it a host
 * socket wins new flows. A port a host socket held when the mapping was
 * made is refused by the agent either way. */
#define DP_PM_WINS 2

/* flow as the sandbox sees it -> how it leaves the node */
struct dp_ct_key {
	__u32 sandbox_ip;
	__u32 remote_ip;
	__u16 guest_port;      /* TCP/UDP source port, ICMP echo id */
	__u16 remote_port;     /* 0 for ICMP */
	__u8 proto;
	__u8 pad[3];
}; /* 16 bytes */
struct dp_ct_val {
	__u64 last_seen_ns;    /* bpf_ktime_get_ns */
	__u16 nat_port;        /* SNAT port / echo id, or the mapped host port */
	__u8 kind;             /* DP_CT_* */
	__u8 state;            /* DP_TCP_* */
	/* TCP, once closing: the last timestamp value and the sequence number
	 * after the last segment the flow sent (what the remote's TIME_WAIT
	 * compares a new SYN on the same tuple with; 0 = none seen). */
	__u32 ts_last;
	__u64 gen;             /* generation of the sandbox that owns the flow */
	__u32 seq_last;
	__u32 pad;
	/* The flow log's totals (docs/flows.md): when the flow's first packet
	 * was seen (0 in entries older builds made: set by the next packet),
	 * and its IP bytes and packets each way, as the sandbox sees it (out:
	 * sent by the sandbox). Read by the reaper for the flow's end record. */
	__u64 start_ns;
	__u64 bytes_out;
	__u64 bytes_in;
	__u32 pkts_out;
	__u32 pkts_in;
}; /* 64 bytes (32 before the flow log: migrated by appending 0) */
#define DP_CT_SNAT 0
#define DP_CT_PORTMAP 1
#define DP_CT_LOCAL 2     /* (earlier builds; host flows are in hflow now) */
#define DP_CT_HOST 3      /* host_nat: a host connection in the SNAT range */
/* TCP state bits of a flow; 0 = open. Any bit: closing (short timeout).
 * RST, or a FIN each way: closed (its tuple may be taken by a new SYN of
 * another flow, as the kernel reuses a TIME_WAIT tuple). */
#define DP_TCP_OPEN 0
#define DP_TCP_FIN_OUT 1  /* FIN from the sandbox (host_nat: from the host) */
#define DP_TCP_FIN_IN 2   /* FIN from the other end */
#define DP_TCP_RST 4
#define DP_TCP_REMOTE_TW 8 /* the other end closed first: it keeps TIME_WAIT */

/* NAT66 flows (docs/dual-stack.md): the IPv6 twins of ct and ct_rev,
 * with the same values. The sandbox is still named by its IPv4 address
 * (unique on the node: generations, by_ip and the reaper serve both
 * families); `gaddr` says which of the guest's addresses sent it. */
struct dp_ct6_key {
	__u32 sandbox_ip;
	__u32 remote_ip[4];
	__u16 guest_port;      /* TCP/UDP source port, ICMPv6 echo id */
	__u16 remote_port;     /* 0 for ICMPv6 */
	__u8 proto;
	__u8 gaddr;            /* DP_GADDR_* */
	__u8 pad[2];
}; /* 28 bytes */
#define DP_GADDR_FIXED 0   /* fd63:7562:6500::6 */
#define DP_GADDR_SLAAC 1   /* the prefix's EUI-64 of the guest MAC */
struct dp_rev6_key {
	__u32 remote_ip[4];
	__u16 remote_port;
	__u16 nat_port;
	__u8 proto;
	__u8 pad[3];
}; /* 24 bytes */
/* ct_rev6 values are dp_rev_val with `pad` = the guest address (DP_GADDR_*). */
/* SNAT replies: (remote, remote port, nat port) -> the sandbox's flow */
struct dp_rev_key {
	__u32 remote_ip;
	__u16 remote_port;
	__u16 nat_port;
	__u8 proto;
	__u8 pad[3];
}; /* 12 bytes */
struct dp_rev_val {
	__u32 sandbox_ip;
	__u16 guest_port;
	__u16 pad;
	__u64 gen;             /* as in the forward entry */
}; /* 16 bytes */

/* Host <-> sandbox flows (the host's own connections to a sandbox IP or a
 * mapped port, and the guest's to the gateway): keyed by the host's tuple
 * as the host sends it (host address and port -> sandbox side). */
struct dp_hflow_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 family;           /* DP_HFAM_* (was padding: 0, IPv4) */
	__u8 pad[2];
}; /* 16 bytes */
/* An IPv6 host flow is keyed by the IPv4 tuple it stands for: the node's
 * side is always the gateway device's IPv6 address (pool6 ‖ host_ip), the
 * sandbox's its sandbox_ipv6 (pool6 ‖ sandbox_ip), so the 32-bit words
 * name them; `family` keeps the two tuple spaces apart. */
#define DP_HFAM_IPV4 0
#define DP_HFAM_IPV6 6
struct dp_hflow_val {
	__u64 last_seen_ns;
	__u64 gen;             /* the sandbox owner's generation */
	__u32 sandbox_ip;
	__u16 guest_port;      /* the guest's port */
	__u16 gw_port;         /* the port the guest sees on 169.254.68.5 */
	__u8 kind;             /* DP_HF_* */
	__u8 state;            /* DP_TCP_* bits */
	__u16 flags;           /* DP_HFF_* (0 in builds before host access) */
	__u32 peer_ip;         /* DP_HF_PROXY: the address the guest dialled */
	__u32 peer6[4];        /* DP_HF_PROXY of DP_HFAM_IPV6: the address the guest dialled */
}; /* 48 bytes (32 in builds before IPv6 steering: migrated) */
/* The node opened the flow to the sandbox address: every packet of it is
 * judged by the sender's uid again (another uid could take the port over
 * once the first socket closed). */
#define DP_HFF_HOST_OPENED 1
/* An IPv6 flow with the guest's static fd63:7562:6500::6 (not its SLAAC
 * address): one it opened from there, or one opened to it while that was
 * its address (sb_share.guest6). Its packets to the guest go there. */
#define DP_HFF_GUEST_FIXED 2
#define DP_HF_GWDEV 0     /* via the gateway device: to the sandbox IP, or the guest to the gateway */
#define DP_HF_LO 1        /* via lo: the host to a mapped port */
/* The guest's flow to peer_ip:gw_port (80/443), delivered to the agent's
 * proxy as sandbox IP -> gateway-device IP:DP_PROXY_*_PORT (the key is the
 * proxy's side); its replies go back from peer_ip:gw_port. No hrev entry:
 * the guest's tuple gives the key. */
#define DP_HF_PROXY 2
/* The guest's side of a host flow: every one has a tuple of its own. */
struct dp_hrev_key {
	__u32 sandbox_ip;
	__u16 guest_port;
	__u16 gw_port;
	__u8 proto;
	__u8 family;           /* DP_HFAM_*, the host flow's */
	__u8 pad[2];
}; /* 12 bytes */
struct dp_hrev_val {
	struct dp_hflow_key host;
	__u64 gen;
}; /* 24 bytes */

/* IP fragments after the first carry no ports: the first fragment of a
 * datagram for a sandbox records where the rest goes. */
struct dp_frag_key {
	__u32 saddr;
	__u32 daddr;
	__u16 id;
	__u8 proto;
	__u8 pad;
}; /* 12 bytes */
struct dp_frag_val {
	__u64 first_seen_ns;
	__u64 gen;             /* the TAP owner's generation (sandboxes) */
	__u32 ifindex;         /* the sandbox's TAP */
	__u32 new_saddr;
	__u32 new_daddr;
	__u32 pad;
}; /* 32 bytes */

/* frags' IPv6 twin (frags6): a datagram from the world to the uplink's
 * IPv6 address whose first fragment went to a sandbox, by its source and
 * Identification (the destination is always the uplink's address). */
struct dp_frag6_key {
	__u32 saddr[4];
	__u32 id;
}; /* 20 bytes */
struct dp_frag6_val {
	__u64 first_seen_ns;
	__u64 gen;             /* the TAP owner's generation */
	__u32 ifindex;         /* the sandbox's TAP */
	__u8 gaddr;            /* DP_GADDR_*: the guest address it went to */
	__u8 pad[3];
}; /* 24 bytes */

/* Per-sandbox counters (sb_stats, keyed by the sandbox's TAP or veth
 * ifindex: a device carries one network for life) of what the device's own
 * statistics cannot say: the datapath's drops by reason and the flows it
 * opened by kind. Counted only on drop and new-flow paths. */
enum dp_sb_counter {
	DP_S_SPOOFED,      /* source MAC/IP or destination MAC not the guest's/gateway's; a guest's RA, redirect, DHCPv6 server message */
	DP_S_POLICY,       /* egress denied by the sandbox's policy */
	DP_S_MALFORMED,    /* a frame the datapath could not parse */
	DP_S_NO_ROUTE,     /* no uplink, no route, a fragment (NAT needs ports), IPv6 off the link (refused) */
	DP_S_NO_PORT,      /* no free SNAT or gateway-side port for a new flow */
	DP_S_UNSUPPORTED,  /* not IPv4/ARP/IPv6, or an IP protocol the datapath does not NAT */
	DP_S_NEW_SNAT,     /* flows the sandbox opened to the world */
	DP_S_NEW_PORTMAP,  /* flows the world opened to a mapped port */
	DP_S_NEW_HOST,     /* flows between the host and the sandbox */
	/* A TCP segment (not a SYN) of a connection this sandbox never opened
	 * (a guest restored from a snapshot, a flow that expired): dropped,
	 * and the guest gets an RST (none for an RST). After the counters
	 * above: entries of older builds (72 bytes) convert by appending 0. */
	DP_S_STALE_TCP,
	DP_S_MAX,
};
/* c: every family; v6: the IPv6 part of each (after c: entries of older
 * builds, c alone, convert by appending 0). */
struct dp_sb_stats {
	__u64 c[DP_S_MAX];
	__u64 v6[DP_S_MAX];
	/* The flow log's token bucket (GCRA): the theoretical arrival time of
	 * the sandbox's next event (CLOCK_MONOTONIC ns), events emitted, and
	 * events lost (bucket empty or ring full). After the counters: older
	 * entries convert by appending 0. */
	__u64 flow_tat;
	__u64 flow_sent;
	__u64 flow_lost;
	/* deny_action "reject": the answers' GCRA (as flow_tat). */
	__u64 reject_tat;
}; /* 192 bytes */

/* A sandbox's IPv6 frames (sb_traffic6, per CPU), from the sandbox's
 * point of view as its device's counters: tx = sent by the sandbox. */
struct dp_traffic6 {
	__u64 tx_bytes;
	__u64 tx_packets;
	__u64 rx_bytes;
	__u64 rx_packets;
}; /* 32 bytes */

/* counters (per CPU) */
enum dp_counter {
	DP_C_ARP_REPLY,
	DP_C_SPOOF_DROP,
	DP_C_POLICY_DROP,
	DP_C_SNAT,
	DP_C_SNAT_REPLY,
	DP_C_PORTMAP,
	DP_C_HOST,
	DP_C_TO_SANDBOX_IP,
	DP_C_NO_PORT,
	DP_C_NO_ROUTE,
	DP_C_MALFORMED,
	DP_C_LOCAL,
	DP_C_PORTMAP_HOST_SOCKET, /* a new flow to a mapped port went to a host socket */
	DP_C_SNAT_HOST_SOCKET,    /* (earlier builds) */
	DP_C_HOST_REMAP,          /* a host connection moved off a sandbox flow's tuple */
	DP_C_FRAG,                /* an IP fragment after the first forwarded to a sandbox */
	DP_C_NO_GW_PORT,          /* a host -> sandbox flow found no free gateway-side port */
	DP_C_FORWARDED_DROP,      /* a forwarded packet for a sandbox address (not the node's own) */
	DP_C_HOST_DENIED,         /* a node process without host access opened a flow to a sandbox */
	DP_C_HOST_SHARE,          /* a host <-> sandbox flow beyond its sandbox's share */
	DP_C_NO_HOST_FLOW,        /* a guest's TCP segment of a host <-> sandbox flow nobody has */
	DP_C_STALE_TCP,           /* a guest's TCP segment of a world flow it never opened (RST back) */
	DP_C_STALE_TCP_RESCUED,   /* ... whose flow entry was evicted: taken back from its reverse entry */
	DP_C_PAUSED_DROP,         /* a packet for a paused sandbox (dropped) */
	DP_C_ND_REPLY,            /* a guest's Router or Neighbour Solicitation (or echo to the gateway) answered */
	DP_C_ROGUE_ND,            /* an RA, redirect or DHCPv6 server message from a guest (dropped) */
	DP_C_IPV6_REFUSED,        /* a guest's IPv6 packet off its link: RST or ICMPv6 unreachable back */
	DP_C_ICMP_ERROR,          /* an ICMP error from the world about a sandbox flow, translated to the guest */
	DP_C_NAT66,               /* a sandbox's IPv6 packet to the world (NAT66) */
	DP_C_NAT66_REPLY,         /* the world's IPv6 packet of a sandbox's NAT66 flow */
	DP_C_NAT66_HOST_HELD,     /* a node's IPv6 packet on a tuple a sandbox's NAT66 flow holds (dropped) */
	DP_C_NODE_ADDR,           /* a sandbox's new flow to a node address or another sandbox's, not a mapping (dropped) */
	DP_C_HAIRPIN,             /* a sandbox's packet to a mapping at the node's address, turned around */
	DP_C_FORGED_SOURCE,       /* a packet from the uplink or a node process with a sandbox identity as source (dropped) */
	DP_C_HOST_NOT_OPENING,    /* a node packet to a sandbox that opens no flow: a TCP segment other than a SYN (dropped) */
	DP_C_MAX,
};

#endif
