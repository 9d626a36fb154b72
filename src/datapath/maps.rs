//! Map key/value types shared with `ebpf/datapath.h`. Each is `#[repr(C)]`
//! with explicit padding; sizes are asserted here at compile time and the
//! pinned maps' key/value sizes are checked against them at load time
//! (aya does not check a reused pin).

/// Config (array map `config`, one entry).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpConfig {
    pub guest_ip: u32,
    pub gateway_ip: u32,
    pub host_ip: u32,
    pub uplink_ip: u32,
    pub uplink_ifindex: u32,
    pub gwdev_ifindex: u32,
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub guest_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    pub gwdev_mac: [u8; 6],
    pub pad: u16,
    /// Host <-> sandbox flows per sandbox (see [`HflowShares`]).
    pub hflow_guaranteed: u32,
    pub hflow_cap: u32,
    pub hflow_borrow: u32,
    /// The shaper device (egress limits) and its peer; 0 = none.
    pub shaper_ifindex: u32,
    pub shaper_peer_ifindex: u32,
    /// `DP_CFG_*` (was padding).
    pub flags: u32,
    /// NAT66: the uplink's global IPv6 address (`DP_CFG_IPV6_EGRESS`),
    /// network byte order.
    pub uplink_ip6: [u8; 16],
    /// Host <-> sandbox over IPv6: the first 96 bits of the sandboxes'
    /// IPv6 identities (`ipv6_pool`); all 0 = none.
    pub pool6: [u8; 12],
    /// The pool's netmask (network order): `host_ip & pool_mask` is the
    /// sandboxes' network (a source the uplink and `lo` never deliver, a
    /// destination that never leaves by the uplink); 0 = none.
    pub pool_mask: u32,
    /// The flow log (`DP_CFG_FLOW_EVENTS`): a sandbox emits an event every
    /// `flow_interval_ns` on average, `flow_burst` at once.
    pub flow_interval_ns: u32,
    pub flow_burst: u32,
}

/// A sandbox's entries in the shared tables (`sb_share`, keyed by its TAP
/// or veth ifindex).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpShare {
    /// Two budgets: the low 16 bits count the host flows the guest opened,
    /// the high 16 those others opened to it ([`DpShare::budgets`]).
    pub hflow: u32,
    /// `DP_SHARE_FIXED6`: the guest's IPv6 address is fd63:7562:6500::6,
    /// not its SLAAC address (learned by the datapath; kept by the agent).
    pub guest6: u32,
}

impl DpShare {
    /// `hflow` as [the guest's own flows, flows others opened].
    pub fn budgets(hflow: u32) -> [i64; 2] {
        [i64::from(hflow & 0xffff), i64::from(hflow >> 16)]
    }

    /// The `hflow` word of these budgets (each at most 0xffff).
    pub fn packed(n: [i64; 2]) -> u32 {
        (n[0].clamp(0, 0xffff) as u32) | ((n[1].clamp(0, 0xffff) as u32) << 16)
    }
}

/// `DpHflowVal::flags`: the node opened the flow (`DP_HFF_HOST_OPENED`).
pub const DP_HFF_HOST_OPENED: u16 = 1;
/// `DpHflowVal::kind`: a flow through lo to a mapped port (`DP_HF_LO`).
pub const DP_HF_LO: u8 = 1;
/// `DpHflowVal::kind`: a guest's flow steered to the agent's resolver or
/// proxy (`peer_ip`/`peer6` the address it dialled).
pub const DP_HF_PROXY: u8 = 2;
/// `DpHflowKey::family` of an IPv4 host flow, and of an IPv6 one.
pub const DP_HFAM_IPV4: u8 = 0;
pub const DP_HFAM_IPV6: u8 = 6;

/// Which budget of its sandbox's share a host flow counts against (as the
/// datapath's `hflow_budget`): true for one the node, or a local process
/// through a mapping on lo, opened.
pub fn hflow_budget(v: &DpHflowVal) -> bool {
    v.flags & DP_HFF_HOST_OPENED != 0 || v.kind == DP_HF_LO
}

/// The node-wide side (`share_pool`, one entry): entries held beyond the
/// guaranteed ones.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpSharePool {
    pub hflow_borrowed: u32,
    /// Of those, the ones flows others opened hold (each budget borrows
    /// at most half the pool); "pad" (0) in builds before.
    pub hflow_borrowed_in: u32,
}

/// How `hflow` (and `hrev`) are shared: every sandbox may hold
/// `guaranteed` entries whatever the others do (the pool's capacity at
/// that many fits half the map); beyond, up to `cap`, from the other half,
/// shared by all (`borrow`). No sandbox, nor all of them together, can
/// take what another one is guaranteed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HflowShares {
    pub guaranteed: u32,
    pub cap: u32,
    pub borrow: u32,
}

/// The most host <-> sandbox flows one sandbox may hold.
pub const HFLOW_CAP_PER_SANDBOX: u32 = 4096;

impl HflowShares {
    /// The guaranteed entries of each budget of a sandbox's share (the
    /// guest's own, others'), as the datapath's `budget_guaranteed`.
    pub fn budgets_guaranteed(&self) -> [u32; 2] {
        let own = self.guaranteed.div_ceil(2);
        [own, self.guaranteed - own]
    }

    /// For a pool of `capacity` sandboxes.
    pub fn for_pool(capacity: u32) -> Self {
        let half = HOST_FLOW_ENTRIES / 2;
        let cap = HFLOW_CAP_PER_SANDBOX.min(half);
        HflowShares {
            guaranteed: (half / capacity.max(1)).clamp(1, cap),
            cap,
            borrow: half,
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpSandbox {
    pub sandbox_ip: u32,
    pub flags: u32,
    /// The owner's generation (the same as in `by_ip`), see [`DpTap::generation`].
    pub generation: u64,
}
pub const DP_F_INTERNET: u32 = 1;
/// The sandbox has domain rules: addresses in `dns_learned` are allowed
/// for new flows, DNS and DoT to others than the gateway dropped.
pub const DP_F_DOMAINS: u32 = 2;
/// Strict egress (`egress_mode` "sni"): TCP to 80/443 goes to the proxy.
pub const DP_F_SNI: u32 = 4;
/// Egress rules: TCP to 80/443 the policy lets out goes to the proxy.
pub const DP_F_RULES: u32 = 64;
/// Traffic to the world is paced by the sandbox's `sb_rate` entry.
pub const DP_F_SHAPE_OUT: u32 = 8;
/// The sandbox's IPv6 reaches the world (NAT66) on a node with IPv6
/// egress ([`crate::types::ipv6_open`]).
pub const DP_F_V6_OUT: u32 = 16;
/// The sandbox has IPv6 policy entries (`policy6_allow`/`policy6_deny`).
pub const DP_F_V6_RULES: u32 = 32;
/// `DpTap::flags`: traffic from the world to the sandbox is paced.
pub const DP_T_SHAPE_IN: u32 = 1;
/// `DpTap::flags`: the sandbox is paused (packets for it dropped, the
/// first of each pause reported in `wakes`).
pub const DP_T_PAUSED: u32 = 2;

/// The first packet for a paused sandbox (`wakes` ring, `wake_sent`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpWake {
    pub generation: u64,
    pub sandbox_ip: u32,
    pub ifindex: u32,
    /// Who sent it (network order): a world address, or the node's own.
    pub remote_ip: u32,
    /// The sandbox's port it was for, and the sender's (network order).
    pub port: u16,
    pub remote_port: u16,
    pub proto: u8,
    /// `DP_WAKE_*`.
    pub kind: u8,
    pub pad: [u8; 6],
}
/// `DpWake::kind`: a reply to a flow the sandbox opened, a flow to one of
/// its port mappings, the node itself.
pub const DP_WAKE_REPLY: u8 = 0;
pub const DP_WAKE_PORTMAP: u8 = 1;
pub const DP_WAKE_HOST: u8 = 2;
/// Bytes of the `wakes` ring buffer (`DP_WAKES_BYTES`).
pub const WAKES_BYTES: u32 = 256 * 1024;
/// `policy_deny` values (ebpf/datapath.h): the catch-all 0.0.0.0/0, which
/// an address learned for an allowed name passes, and every other deny
/// CIDR, which beats it.
pub const DP_DENY_CATCH_ALL: u8 = 1;
pub const DP_DENY_BEATS_LEARNED: u8 = 2;
/// The proxy's ports on the gateway-device address (ebpf/datapath.h).
pub const DP_PROXY_HTTP_PORT: u16 = 1022;
pub const DP_PROXY_TLS_PORT: u16 = 1021;

/// `dns_learned` key: (sandbox ip, destination), network byte order.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpLearnedKey {
    pub sandbox_ip: u32,
    pub dst: u32,
}

/// `dns_learned6` key: the IPv6 twin (AAAA answers).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpLearned6Key {
    pub sandbox_ip: u32,
    pub dst: [u8; 16],
}

/// `dns_learned` value: until when (CLOCK_MONOTONIC ns) a new flow may
/// start, for which owner generation of the address.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpLearnedVal {
    pub expires_ns: u64,
    pub generation: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpTap {
    pub ifindex: u32,
    /// `DP_T_*` (0 in builds before bandwidth limits).
    pub flags: u32,
    /// Generation of the address's current owner: set when an address is
    /// attached with no `by_ip` entry (a new owner), kept by every later
    /// attach of it (converge, recovery, Reconcile, agent restarts: it is
    /// read back from this pinned map). Every flow records the generation
    /// that created it; the datapath ignores (and deletes) a flow of
    /// another generation, the reaper removes them, so a released
    /// sandbox's flows never reach the next owner of the address.
    pub generation: u64,
}

/// The data part of an LPM key (aya adds the 4-byte prefix length).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpPolicyData {
    pub sandbox_ip: u32,
    pub dst: u32,
}

/// The IPv6 twin of [`DpPolicyData`] (`policy6_allow`/`policy6_deny`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpPolicy6Data {
    pub sandbox_ip: u32,
    pub dst: [u8; 16],
}

/// `host_ip` 0 is the wildcard (every node address: the uplink address
/// and 127.0.0.0/8); anything else matches only that destination.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpPortmapKey {
    pub host_ip: u32,
    pub host_port: u16,
    pub proto: u8,
    pub pad: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpPortmapVal {
    pub sandbox_ip: u32,
    pub container_port: u16,
    /// `DP_PM_*` (0 in builds before IPv6-only mappings).
    pub flags: u16,
}

/// `DpPortmapVal::flags`: the mapping is on the node's IPv6 address only.
pub const DP_PM_V6_ONLY: u16 = 1;
/// `DpPortmapVal::flags`: the mapping wins over host sockets on its port
/// (`SandboxPath::mapping_wins`).
pub const DP_PM_WINS: u16 = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpCtKey {
    pub sandbox_ip: u32,
    pub remote_ip: u32,
    pub guest_port: u16,
    pub remote_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpCtVal {
    pub last_seen_ns: u64,
    pub nat_port: u16,
    pub kind: u8,
    pub state: u8,
    /// TCP, once closing: the last timestamp value the flow sent.
    pub ts_last: u32,
    /// Generation of the owner that created the flow ([`DpTap::generation`]).
    pub generation: u64,
    /// TCP, once closing: the sequence number after its last segment.
    pub seq_last: u32,
    pub pad: u32,
    /// The flow log: when the flow's first packet was seen (monotonic ns;
    /// 0 in entries of older builds until their next packet), and its IP
    /// bytes and packets each way (out: sent by the sandbox).
    pub start_ns: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub pkts_out: u32,
    pub pkts_in: u32,
}
pub const DP_CT_SNAT: u8 = 0;
pub const DP_CT_PORTMAP: u8 = 1;
pub const DP_CT_LOCAL: u8 = 2;
pub const DP_CT_HOST: u8 = 3;
/// TCP state bits (0 = open; any bit = closing, the short timeout).
pub const DP_TCP_FIN_OUT: u8 = 1;
pub const DP_TCP_FIN_IN: u8 = 2;
pub const DP_TCP_RST: u8 = 4;
/// The other end closed first and keeps the tuple in TIME_WAIT.
pub const DP_TCP_REMOTE_TW: u8 = 8;
/// How long a remote keeps TIME_WAIT (Linux's TCP_TIMEWAIT_LEN): a flow
/// whose remote closed first is kept at least this long, so a new flow on
/// its tuple is judged against what it sent last.
pub const REMOTE_TIME_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpRevKey {
    pub remote_ip: u32,
    pub remote_port: u16,
    pub nat_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// A NAT66 flow as the sandbox sees it (`ct6`; values are [`DpCtVal`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpCt6Key {
    pub sandbox_ip: u32,
    pub remote_ip: [u8; 16],
    pub guest_port: u16,
    pub remote_port: u16,
    pub proto: u8,
    /// Which of the guest's addresses sent it (0 the fixed one, 1 SLAAC).
    pub gaddr: u8,
    pub pad: [u8; 2],
}

/// NAT66 replies (`ct_rev6`; values are [`DpRevVal`], `pad` = the guest
/// address as in [`DpCt6Key::gaddr`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpRev6Key {
    pub remote_ip: [u8; 16],
    pub remote_port: u16,
    pub nat_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpRevVal {
    pub sandbox_ip: u32,
    pub guest_port: u16,
    pub pad: u16,
    /// As in the forward entry.
    pub generation: u64,
}

/// A host <-> sandbox flow, keyed by the host's tuple as the host sends it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpHflowKey {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// `DP_HFAM_IPV4` (0, formerly padding) or `DP_HFAM_IPV6`: an IPv6
    /// host flow is keyed by the IPv4 words its addresses end with.
    pub family: u8,
    pub pad: [u8; 2],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpHflowVal {
    pub last_seen_ns: u64,
    pub generation: u64,
    pub sandbox_ip: u32,
    pub guest_port: u16,
    /// The port the guest sees on the gateway side.
    pub gw_port: u16,
    pub kind: u8,
    pub state: u8,
    /// `DP_HFF_*` (0 in builds before host access).
    pub flags: u16,
    /// `DP_HF_PROXY`: the address the guest dialled (network order).
    pub peer_ip: u32,
    /// `DP_HF_PROXY` of an IPv6 flow: the address the guest dialled.
    pub peer6: [u8; 16],
}

/// The guest's side of a host flow.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpHrevKey {
    pub sandbox_ip: u32,
    pub guest_port: u16,
    pub gw_port: u16,
    pub proto: u8,
    /// The host flow's `family`.
    pub family: u8,
    pub pad: [u8; 2],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpHrevVal {
    pub host: DpHflowKey,
    pub generation: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpFragKey {
    pub saddr: u32,
    pub daddr: u32,
    pub id: u16,
    pub proto: u8,
    pub pad: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpFragVal {
    pub first_seen_ns: u64,
    pub generation: u64,
    pub ifindex: u32,
    pub new_saddr: u32,
    pub new_daddr: u32,
    pub pad: u32,
}

/// `frags6` key (struct dp_frag6_key): the world's source and the
/// datagram's Identification.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DpFrag6Key {
    pub saddr: [u8; 16],
    pub id: u32,
}

/// `frags6` value (struct dp_frag6_val).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpFrag6Val {
    pub first_seen_ns: u64,
    pub generation: u64,
    pub ifindex: u32,
    pub gaddr: u8,
    pub pad: [u8; 3],
}

/// `sb_rate` value (struct dp_rate), keyed by the sandbox's TAP or veth
/// ifindex: its classes in the uplink's shaper.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpRate {
    /// The uplink's classes of the sandbox; 0: no egress limit.
    pub out_small: u32,
    pub out_bulk: u32,
    /// 1: the sandbox's device has a shaper (an ingress limit).
    pub in_shaped: u32,
    pub pad: u32,
}

/// The classes of the shaper on a sandbox's own device (ingress limits),
/// as the datapath sets them (DP_TAP_CLASS_*): parent, small, bulk.
pub const TAP_CLASS_PARENT: u32 = 0xc0be_0001;
pub const TAP_CLASS_SMALL: u32 = 0xc0be_0002;
pub const TAP_CLASS_BULK: u32 = 0xc0be_0003;
/// The handle of every shaper qdisc the agent makes (`c0be:`).
pub const SHAPER_HANDLE: u32 = 0xc0be_0000;
/// Packets of at most this many bytes go to the "small" class.
pub const SHAPE_SMALL: u32 = 256;

/// A sandbox's shaper counters (its HTB classes' statistics), after
/// [`SB_COUNTER_NAMES`] and [`SB_COUNTER_NAMES_IPV6`] in what
/// `Datapath::sandbox_counters` returns:
/// packets and bytes that went through the shaper, how often one had to
/// wait for the rate (overlimits), and drops (the class's queue full).
pub const RATE_COUNTER_NAMES: &[&str] = &[
    "egress_shaped_packets",
    "egress_shaped_bytes",
    "egress_delayed",
    "egress_rate_dropped_packets",
    "ingress_shaped_packets",
    "ingress_shaped_bytes",
    "ingress_delayed",
    "ingress_rate_dropped_packets",
];

/// A sandbox's own datapath counters (`sb_stats`, keyed by its TAP or
/// veth ifindex), indexed by [`SB_COUNTER_NAMES`]: `c` of every family,
/// `v6` the IPv6 part of each.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpSbStats {
    pub c: [u64; SB_COUNTER_NAMES.len()],
    pub v6: [u64; SB_COUNTER_NAMES.len()],
    /// The flow log's token bucket (its next event's theoretical arrival
    /// time), events emitted and events lost (bucket empty, ring full).
    pub flow_tat: u64,
    pub flow_sent: u64,
    pub flow_lost: u64,
    /// deny_action "reject": the answers' rate (as `flow_tat`).
    pub reject_tat: u64,
}

/// A sandbox's IPv6 frames (`sb_traffic6`, one per CPU, summed when read):
/// the IPv6 part of its device's counters, from the sandbox's side.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpTraffic6 {
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
}

impl DpTraffic6 {
    /// The sum of the CPUs' parts.
    pub fn sum<'a>(parts: impl IntoIterator<Item = &'a Self>) -> [u64; 4] {
        parts.into_iter().fold([0; 4], |a, p| {
            [
                a[0] + p.tx_bytes,
                a[1] + p.tx_packets,
                a[2] + p.rx_bytes,
                a[3] + p.rx_packets,
            ]
        })
    }
}

/// [`DpTraffic6`]'s counters, as GetNetwork's traffic names them.
pub const TRAFFIC6_NAMES: [&str; 4] = [
    "tx_bytes_ipv6",
    "tx_packets_ipv6",
    "rx_bytes_ipv6",
    "rx_packets_ipv6",
];

/// enum dp_sb_counter: the datapath's drops by reason, then the flows it
/// opened by kind (docs/observability.md).
pub const SB_COUNTER_NAMES: &[&str] = &[
    "drop_spoofed",
    "drop_policy",
    "drop_malformed",
    "drop_no_route",
    "drop_no_port",
    "drop_unsupported",
    "new_flows_snat",
    "new_flows_portmap",
    "new_flows_host",
    "drop_stale_tcp",
];

/// The IPv6 part of each of [`SB_COUNTER_NAMES`] (`DpSbStats::v6`): the
/// same name with `_ipv6`.
pub const SB_COUNTER_NAMES_IPV6: &[&str] = &[
    "drop_spoofed_ipv6",
    "drop_policy_ipv6",
    "drop_malformed_ipv6",
    "drop_no_route_ipv6",
    "drop_no_port_ipv6",
    "drop_unsupported_ipv6",
    "new_flows_snat_ipv6",
    "new_flows_portmap_ipv6",
    "new_flows_host_ipv6",
    "drop_stale_tcp_ipv6",
];

// Each type below is #[repr(C)], Copy, made only of integers and byte
// arrays with explicit padding fields, so every bit pattern is valid and
// there are no implicit padding bytes (the sizes are asserted below).
// SAFETY: see above.
unsafe impl aya::Pod for DpConfig {}
// SAFETY: see above.
unsafe impl aya::Pod for DpSbStats {}
// SAFETY: repr(C), four u64: no padding, every bit pattern valid.
unsafe impl aya::Pod for DpTraffic6 {}
// SAFETY: see above.
unsafe impl aya::Pod for DpRate {}
// SAFETY: see above.
unsafe impl aya::Pod for DpWake {}
// SAFETY: see above.
unsafe impl aya::Pod for DpShare {}
// SAFETY: see above.
unsafe impl aya::Pod for DpSharePool {}
// SAFETY: see above.
unsafe impl aya::Pod for DpSandbox {}
// SAFETY: see above.
unsafe impl aya::Pod for DpLearnedKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpLearnedVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpTap {}
// SAFETY: see above.
unsafe impl aya::Pod for DpPolicyData {}
// SAFETY: see above.
unsafe impl aya::Pod for DpPolicy6Data {}
// SAFETY: see above.
unsafe impl aya::Pod for DpLearned6Key {}
// SAFETY: see above.
unsafe impl aya::Pod for DpPortmapKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpPortmapVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpCtKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpCtVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpRevKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpRevVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpCt6Key {}
// SAFETY: see above.
unsafe impl aya::Pod for DpRev6Key {}
// SAFETY: see above.
unsafe impl aya::Pod for DpHflowKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpHflowVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpHrevKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpHrevVal {}
// SAFETY: see above.
unsafe impl aya::Pod for DpFragKey {}
// SAFETY: see above.
unsafe impl aya::Pod for DpFragVal {}

// The C side's sizes (ebpf/datapath.h comments); a mismatch fails the build.
const _: () = {
    assert!(size_of::<DpCt6Key>() == 28);
    assert!(size_of::<DpRev6Key>() == 24);
    assert!(size_of::<DpShare>() == 8);
    assert!(size_of::<DpSharePool>() == 8);
    assert!(size_of::<DpSandbox>() == 16);
    assert!(size_of::<DpTap>() == 16);
    assert!(size_of::<DpLearnedKey>() == 8);
    assert!(size_of::<DpLearned6Key>() == 20);
    assert!(size_of::<DpLearnedVal>() == 16);
    assert!(size_of::<DpPolicyData>() + 4 == 12);
    assert!(size_of::<DpPolicy6Data>() + 4 == 24);
    assert!(size_of::<DpPortmapKey>() == 8);
    assert!(size_of::<DpPortmapVal>() == 8);
    assert!(size_of::<DpCtKey>() == 16);
    assert!(size_of::<DpCtVal>() == 64);
    assert!(size_of::<DpFlowEvent>() == 120);
    assert!(size_of::<DpConfig>() == 112);
    assert!(size_of::<DpRevKey>() == 12);
    assert!(size_of::<DpRevVal>() == 16);
    assert!(size_of::<DpHflowKey>() == 16);
    assert!(size_of::<DpHflowVal>() == 48);
    assert!(size_of::<DpHrevKey>() == 12);
    assert!(size_of::<DpHrevVal>() == 24);
    assert!(size_of::<DpFragKey>() == 12);
    assert!(size_of::<DpFragVal>() == 32);
    assert!(size_of::<DpFrag6Key>() == 20);
    assert!(size_of::<DpFrag6Val>() == 24);
    assert!(size_of::<DpSbStats>() == 192);
    assert!(size_of::<DpTraffic6>() == 32);
    assert!(SB_COUNTER_NAMES_IPV6.len() == SB_COUNTER_NAMES.len());
    assert!(size_of::<DpRate>() == 16);
    assert!(size_of::<DpWake>() == 32);
};

/// `tails` slots (TAIL_* in ebpf/lib/maps.h) and their programs.
pub const TAILS: [(u32, &str); 7] = [
    (0, "guest6_out"),
    (1, "uplink6_in"),
    (2, "guest6_rst"),
    (3, "icmp6_error"),
    (4, "guest6_steer"),
    (5, "uplink6_frag"),
    (6, "host_to_sandbox6"),
];

/// Entries of the per-sandbox maps (`max_entries` in ebpf/lib/maps.h).
pub const SANDBOX_MAP_ENTRIES: u32 = 65536;
/// Entries of the flow maps `ct` and `ct_rev`.
pub const FLOW_MAP_ENTRIES: u32 = 262144;
/// Entries of `host_nat`.
pub const HOST_NAT_ENTRIES: u32 = 65536;
/// Entries of `hflow` and `hrev` (`DP_HFLOW_MAX`): plain hashes, shared
/// by [`HflowShares`].
pub const HOST_FLOW_ENTRIES: u32 = 262144;
/// Entries of `host_access` (uids granted host access).
pub const HOST_ACCESS_ENTRIES: u32 = 256;
/// Entries of `frags`.
pub const FRAG_ENTRIES: u32 = 8192;
/// Entries of `node_addrs` and `node_addrs6` (`DP_NODE_ADDRS_MAX`): the
/// node's own addresses, each family.
pub const NODE_ADDRS_ENTRIES: u32 = 4096;
/// Entries of `dns_learned` (`DP_LEARNED_MAX`): 10,000 sandboxes x 100.
pub const LEARNED_ENTRIES: u32 = 1_048_576;

/// What a pinned map whose layout differs from this build's may become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Flows, addresses, generations, policies, port maps, counters: the
    /// entries are migrated into the new layout (see `pins.rs`), or the
    /// agent refuses to start.
    Durable,
    /// Rewritten at every start (`config`) or short-lived (`frags`): a map
    /// of another layout is simply recreated.
    Rebuilt,
}

/// A map this build pins, with its layout (what `pins.rs` compares a pin
/// left by another build with).
#[derive(Debug, Clone, Copy)]
pub struct PinnedMap {
    pub name: &'static str,
    pub kind: aya::maps::MapType,
    pub key: usize,
    pub value: usize,
    pub entries: u32,
    pub keep: Keep,
}

const fn pinned(
    name: &'static str,
    kind: aya::maps::MapType,
    key: usize,
    value: usize,
    entries: u32,
    keep: Keep,
) -> PinnedMap {
    PinnedMap {
        name,
        kind,
        key,
        value,
        entries,
        keep,
    }
}

/// Every map of the datapath (ebpf/lib/maps.h) with this build's layout.
pub const PINNED: &[PinnedMap] = {
    use Keep::*;
    use aya::maps::MapType::*;
    let policy_key = size_of::<DpPolicyData>() + 4;
    let policy6_key = size_of::<DpPolicy6Data>() + 4;
    &[
        pinned("config", Array, 4, size_of::<DpConfig>(), 1, Rebuilt),
        pinned("node_addrs", Hash, 4, 1, NODE_ADDRS_ENTRIES, Rebuilt),
        pinned("node_addrs6", Hash, 16, 1, NODE_ADDRS_ENTRIES, Rebuilt),
        // The flow log's scratch (`struct dp_flow_totals`, per CPU).
        pinned("flow_scratch", PerCpuArray, 4, 32, 1, Rebuilt),
        pinned(
            "counters",
            PerCpuArray,
            4,
            8,
            COUNTER_NAMES.len() as u32,
            Durable,
        ),
        pinned(
            "sandboxes",
            Hash,
            4,
            size_of::<DpSandbox>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "by_ip",
            Hash,
            4,
            size_of::<DpTap>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "policy_allow",
            LpmTrie,
            policy_key,
            1,
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "policy_deny",
            LpmTrie,
            policy_key,
            1,
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "policy6_allow",
            LpmTrie,
            policy6_key,
            1,
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "policy6_deny",
            LpmTrie,
            policy6_key,
            1,
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "portmap",
            Hash,
            size_of::<DpPortmapKey>(),
            size_of::<DpPortmapVal>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "ct",
            LruHash,
            size_of::<DpCtKey>(),
            size_of::<DpCtVal>(),
            FLOW_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "ct_rev",
            LruHash,
            size_of::<DpRevKey>(),
            size_of::<DpRevVal>(),
            FLOW_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "ct6",
            LruHash,
            size_of::<DpCt6Key>(),
            size_of::<DpCtVal>(),
            FLOW_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "ct_rev6",
            LruHash,
            size_of::<DpRev6Key>(),
            size_of::<DpRevVal>(),
            FLOW_MAP_ENTRIES,
            Durable,
        ),
        // Program fds: every start writes its own programs.
        pinned("tails", ProgramArray, 4, 4, TAILS.len() as u32, Rebuilt),
        // The only record of which TAPs an older build attached.
        pinned("tap_attached", Hash, 4, 4, SANDBOX_MAP_ENTRIES, Durable),
        pinned(
            "host_nat",
            LruHash,
            size_of::<DpRevKey>(),
            size_of::<DpCtVal>(),
            HOST_NAT_ENTRIES,
            Durable,
        ),
        pinned(
            "hflow",
            Hash,
            size_of::<DpHflowKey>(),
            size_of::<DpHflowVal>(),
            HOST_FLOW_ENTRIES,
            Durable,
        ),
        pinned(
            "hrev",
            Hash,
            size_of::<DpHrevKey>(),
            size_of::<DpHrevVal>(),
            HOST_FLOW_ENTRIES,
            Durable,
        ),
        pinned(
            "sb_share",
            Hash,
            4,
            size_of::<DpShare>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned("share_pool", Array, 4, size_of::<DpSharePool>(), 1, Durable),
        // Written from the configuration at every start.
        pinned("host_access", Hash, 4, 1, HOST_ACCESS_ENTRIES, Rebuilt),
        pinned(
            "frags",
            LruHash,
            size_of::<DpFragKey>(),
            size_of::<DpFragVal>(),
            FRAG_ENTRIES,
            Rebuilt,
        ),
        pinned(
            "frags6",
            LruHash,
            size_of::<DpFrag6Key>(),
            size_of::<DpFrag6Val>(),
            FRAG_ENTRIES,
            Rebuilt,
        ),
        pinned(
            "dns_learned",
            Hash,
            size_of::<DpLearnedKey>(),
            size_of::<DpLearnedVal>(),
            LEARNED_ENTRIES,
            Durable,
        ),
        pinned(
            "dns_learned6",
            Hash,
            size_of::<DpLearned6Key>(),
            size_of::<DpLearnedVal>(),
            LEARNED_ENTRIES,
            Durable,
        ),
        pinned(
            "sb_stats",
            Hash,
            4,
            size_of::<DpSbStats>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        // Made with the sandbox's sb_stats entry, removed by the reaper
        // with the device (as sb_stats); the datapath only adds to it.
        pinned(
            "sb_traffic6",
            PerCpuHash,
            4,
            size_of::<DpTraffic6>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "sb_rate",
            Hash,
            4,
            size_of::<DpRate>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned(
            "wake_sent",
            Hash,
            4,
            size_of::<DpWake>(),
            SANDBOX_MAP_ENTRIES,
            Durable,
        ),
        pinned("wakes", RingBuf, 0, 0, WAKES_BYTES, Durable),
        pinned("flow_events", RingBuf, 0, 0, FLOW_EVENTS_BYTES, Durable),
    ]
};

/// `dp_config.flags`: the flow log's events (`DP_CFG_FLOW_EVENTS`).
pub const DP_CFG_FLOW_EVENTS: u32 = 4;
/// `dp_config.flags`: deny_action "reject" (`DP_CFG_REJECT`).
pub const DP_CFG_REJECT: u32 = 8;

/// Bytes of the `flow_events` ring (`DP_FLOW_EVENTS_BYTES`).
pub const FLOW_EVENTS_BYTES: u32 = 2 * 1024 * 1024;

/// A flow event (`struct dp_flow_event`, the `flow_events` ring):
/// addresses and ports in network order (IPv4 in the first 4 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpFlowEvent {
    pub ts_ns: u64,
    pub generation: u64,
    pub ifindex: u32,
    pub sandbox_ip: u32,
    /// `DP_FE_*`.
    pub kind: u8,
    /// `DP_FR_*` (refused).
    pub reason: u8,
    /// `DP_FD_*`.
    pub dir: u8,
    /// 4 or 6.
    pub family: u8,
    pub proto: u8,
    /// `DP_FV_*`.
    pub via: u8,
    pub node_port: u16,
    pub guest_port: u16,
    pub remote_port: u16,
    pub guest_ip: [u8; 16],
    pub remote_ip: [u8; 16],
    pub node_ip: [u8; 16],
    pub pad: u32,
    /// `DP_FE_END`: the flow's totals.
    pub start_ns: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub pkts_out: u32,
    pub pkts_in: u32,
}
pub const DP_FE_START: u8 = 1;
pub const DP_FE_REFUSED: u8 = 2;
/// A flow's end the datapath saw (a SYN reopened its closed tuple first).
pub const DP_FE_END: u8 = 3;
pub const DP_FD_EGRESS: u8 = 0;
pub const DP_FD_INGRESS: u8 = 1;
pub const DP_FD_HOST: u8 = 2;
pub const DP_FV_SNAT: u8 = 1;
pub const DP_FV_PORTMAP: u8 = 2;
pub const DP_FV_FROM_NODE: u8 = 3;
pub const DP_FV_TO_GATEWAY: u8 = 4;

/// `dp_config.flags`: the guests' IPv6 link is on.
pub const DP_CFG_IPV6: u32 = 1;
/// `dp_config.flags`: NAT66 (the uplink has a global IPv6 address and an
/// IPv6 default route).
pub const DP_CFG_IPV6_EGRESS: u32 = 2;

impl DpConfig {
    /// The config writes that take the running datapath from `self` to the
    /// uplink's IPv6 address `addr`, in order. A map write is a plain copy
    /// that a packet on another CPU may read half done, and every program
    /// reads `flags` before it uses `uplink_ip6`: so no write changes the
    /// address while `DP_CFG_IPV6_EGRESS` is set. NAT66 is turned off
    /// first, the address changed, NAT66 turned on; the caller waits
    /// between writes for the packets already in flight (a program run
    /// takes microseconds). Empty when nothing changes.
    pub fn uplink6_steps(&self, addr: Option<std::net::Ipv6Addr>) -> Vec<DpConfig> {
        let ip6 = addr.map_or([0; 16], |a| a.octets());
        let mut cur = *self;
        let mut steps = vec![];
        if cur.flags & DP_CFG_IPV6_EGRESS != 0 && (addr.is_none() || cur.uplink_ip6 != ip6) {
            cur.flags &= !DP_CFG_IPV6_EGRESS;
            steps.push(cur);
        }
        if cur.uplink_ip6 != ip6 {
            cur.uplink_ip6 = ip6;
            steps.push(cur);
        }
        if addr.is_some() && cur.flags & DP_CFG_IPV6_EGRESS == 0 {
            cur.flags |= DP_CFG_IPV6_EGRESS;
            steps.push(cur);
        }
        steps
    }
}

/// Counter indexes (enum dp_counter).
pub const COUNTER_NAMES: &[&str] = &[
    "arp_reply",
    "spoof_drop",
    "policy_drop",
    "snat",
    "snat_reply",
    "portmap",
    "host",
    "to_sandbox_ip",
    "no_port",
    "no_route",
    "malformed",
    "local",
    "portmap_host_socket",
    "snat_host_socket",
    "host_remap",
    "frag",
    "no_gw_port",
    "forwarded_to_sandbox_drop",
    "host_access_denied",
    "host_flow_share_full",
    "no_host_flow",
    "stale_tcp",
    "stale_tcp_rescued",
    "paused_drop",
    "nd_reply",
    "rogue_nd",
    "ipv6_refused",
    "icmp_error",
    "nat66",
    "nat66_reply",
    "nat66_host_held",
    "node_addr_drop",
    "hairpin",
    "forged_source_drop",
    "host_not_opening_drop",
];

#[cfg(test)]
mod uplink6_tests {
    use super::*;

    /// Every write changes either the flags alone or the address alone,
    /// the latter only with NAT66 off; the last one is the target.
    #[test]
    fn no_write_changes_the_address_under_nat66() {
        let a: std::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
        let b: std::net::Ipv6Addr = "2001:db8::2".parse().unwrap();
        let cfg = |addr: Option<std::net::Ipv6Addr>| DpConfig {
            flags: DP_CFG_IPV6
                | if addr.is_some() {
                    DP_CFG_IPV6_EGRESS
                } else {
                    0
                },
            uplink_ip6: addr.map_or([0; 16], |a| a.octets()),
            host_ip: 7,
            ..Default::default()
        };
        for (from, to, writes) in [
            (None, Some(a), 2),
            (Some(a), None, 2),
            (Some(a), Some(b), 3),
            (Some(a), Some(a), 0),
            (None, None, 0),
        ] {
            let start = cfg(from);
            let steps = start.uplink6_steps(to);
            assert_eq!(steps.len(), writes, "{from:?} -> {to:?}");
            let mut prev = start;
            for s in &steps {
                let flags_changed = s.flags != prev.flags;
                let addr_changed = s.uplink_ip6 != prev.uplink_ip6;
                assert!(flags_changed != addr_changed, "{from:?} -> {to:?}: {s:?}");
                if addr_changed {
                    assert_eq!(s.flags & DP_CFG_IPV6_EGRESS, 0, "{from:?} -> {to:?}");
                }
                assert_eq!(s.host_ip, 7);
                prev = *s;
            }
            assert_eq!(prev, cfg(to), "{from:?} -> {to:?}");
        }
    }
}

#[cfg(test)]
mod sb_names_tests {
    #[test]
    fn each_ipv6_counter_is_its_total_with_the_suffix() {
        for (t, v6) in super::SB_COUNTER_NAMES
            .iter()
            .zip(super::SB_COUNTER_NAMES_IPV6)
        {
            assert_eq!(format!("{t}_ipv6"), *v6);
        }
    }
}
