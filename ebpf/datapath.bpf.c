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
 *
 * The source is a folder, one build (as Cilium's bpf/ is laid out): this
 * file is the only translation unit, compiled alone into datapath.bpf.o
 * (Makefile, ../build.rs); it includes the rest below, in order.
 *   datapath.h    map keys and values, constants: shared with the Rust side
 *                 (src/datapath/maps.rs)
 *   lib/X.h       the machinery, one concern per file (each file's first
 *                 comment, and the list below, say which)
 *   prog/X.h      the entry programs, one per file named after the program,
 *                 with the helpers only that program uses
 * None of them is compiled alone, nor has include guards or includes of its
 * own: each uses what the files before it define, so the order below is
 * the order of dependencies. It is also the order of the global functions
 * and programs in the object, which the compiler follows when it inlines:
 * moving one may change the code of others (stack slots), so check with
 * llvm-objdump that a pure move compiles to the same instructions. A new
 * file is added to the list below; the Makefile and build.rs pick up
 * every file of lib/ and prog/.
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

/* The upgrade test (tests/upgrade/build-next.sh) builds a second datapath
 * that differs only here (1): every program gets another tag and behaves
 * the same. */
#define DP_BUILD_SALT 0

char LICENSE[] SEC("license") = "GPL";

/* The machinery, by concern. */
#include "lib/proto.h"        /* protocol numbers, headers uapi lacks, l4info */
#include "lib/maps.h"         /* every map (pinned by name) and the tail-call slots */
#include "lib/counters.h"     /* global and per-sandbox counters, IPv6 traffic */
#include "lib/config.h"       /* get_config: the agent's configuration */
#include "lib/node_addrs.h"   /* the node's addresses (node_dst*), forged sources */
#include "lib/ipv6.h"         /* ICMPv6/ND numbers, the IPv6 header, link addresses */
#include "lib/csum.h"         /* checksum sums, folds and RFC 1624 updates */
#include "lib/packet.h"       /* parse IPv4/IPv6 and L4, rewrite addresses, ports, MACs */
#include "lib/guest6_addr.h"  /* which IPv6 address a guest uses (fixed or SLAAC) */
#include "lib/share.h"        /* a sandbox's share of host-flow entries */
#include "lib/tcp.h"          /* TCP state, timestamps, TIME_WAIT reuse */
#include "lib/host_socket.h"  /* "the host wins": would a node socket take it */
#include "lib/flow_log.h"    /* the flow log: events, a flow's totals */
#include "lib/nat.h"          /* IPv4 SNAT, flow tables ct/ct_rev, SNAT ports */
#include "lib/host_flow.h"    /* host <-> sandbox flows (hflow/hrev), admission */
#include "lib/arp.h"          /* proxy ARP */
#include "lib/frag.h"         /* IPv4 fragments follow their first */
#include "lib/forward.h"      /* out of the uplink: FIB, next hop, hairpin */
#include "lib/policy.h"       /* egress policy, learned addresses, the v6 world */
#include "lib/steer.h"        /* DNS to the resolver, strict mode to the proxy */
#include "lib/guest_to_host.h" /* guest -> gateway (IPv4 and IPv6) */
#include "lib/pause.h"        /* paused sandboxes: drop and wake the agent */
#include "lib/stale_reset.h"  /* RST for connections a sandbox never opened */
#include "lib/reject.h"       /* refusals: noted, dropped or answered (deny_action) */
#include "lib/ipv6_link.h"    /* the guests' IPv6 link: RA, NS/NA, echo, refusals */
#include "lib/nat66.h"        /* NAT66: the IPv6 twins of SNAT (ct6/ct_rev6) */
#include "lib/portmap.h"      /* port mappings (IPv4 and IPv6) */
#include "lib/icmp_error.h"   /* ICMP/ICMPv6 error translation */

/* The programs (SEC("classifier")): the tail-call targets first, then the
 * programs the agent attaches. */
#include "prog/guest6_out.h"
#include "prog/icmp6_error.h"
#include "prog/guest6_rst.h"
#include "prog/uplink6_in.h"
#include "prog/uplink6_frag.h"
#include "prog/guest6_steer.h"
#include "prog/host_to_sandbox6.h"
#include "prog/from_guest.h"
#include "prog/from_uplink.h"
#include "prog/from_shaper.h"
#include "prog/to_sandbox_ip.h"
#include "prog/from_host.h"
#include "prog/to_uplink.h"
