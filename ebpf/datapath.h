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
}; /* 48 bytes */

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

/* sandbox ip -> TAP */
struct dp_tap {
	__u32 ifindex;
	__u32 pad;
	__u64 gen;             /* the owner's generation */
}; /* 16 bytes */

/* policy tries: 64-bit key = sandbox ip (32 bits) + destination prefix */
struct dp_policy_key {
	__u32 prefixlen;       /* 32 + CIDR length */
	__u32 sandbox_ip;
	__u32 dst;
}; /* 12 bytes */

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
	__u16 pad;
}; /* 8 bytes */

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
	__u32 local_addr;      /* DP_CT_LOCAL: the address the host dialled */
	__u64 gen;             /* generation of the sandbox that owns the flow */
}; /* 24 bytes */
#define DP_CT_SNAT 0
#define DP_CT_PORTMAP 1
#define DP_CT_LOCAL 2     /* host -> 127.x / uplink IP : host port, via lo */
#define DP_TCP_OPEN 0
#define DP_TCP_CLOSING 1  /* FIN or RST seen */

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
	DP_C_SNAT_HOST_SOCKET,    /* a reply matching a SNAT flow went to a host socket */
	DP_C_MAX,
};

#endif
