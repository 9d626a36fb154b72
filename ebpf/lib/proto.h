// SPDX-License-Identifier: GPL-2.0
/* Protocol constants and header layouts the uapi headers included by
 * datapath.bpf.c lack (ICMP, ARP, TCP flags), the offsets of the IPv4
 * header's fields, struct l4info (what every path parses of L4) and the
 * directions of a flow (DIR_*).
 * Part of datapath.bpf.c's one translation unit (see there). */

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
