//! The per-sandbox datapath behind each TAP.
//!
//! The agent core calls this seam at every state change: `attach` after a
//! TAP is configured (ensure, convergence and recovery call it; it must be
//! idempotent), `detach` before the TAP goes back to the pool, `checks` for
//! Health. The eBPF implementation (proxy ARP, SNAT, port mappings, policy)
//! plugs in here; [`NoopDatapath`] is the implementation used until it
//! exists, and stays useful as the driver for hosts that route sandboxes by
//! other means.

pub mod ebpf;
mod error;
pub mod maps;
pub mod pins;
pub mod ra;
pub mod shaper;
pub mod tc;

use std::net::IpAddr;

pub use error::DatapathError;

use crate::netlink::TcHook;
use crate::types::PortMapping;

/// Everything the datapath needs to know about one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxPath<'a> {
    pub sandbox_id: &'a str,
    pub tap_name: &'a str,
    pub tap_ifindex: u32,
    pub sandbox_ip: IpAddr,
    pub port_mappings: &'a [PortMapping],
    pub allow_internet_access: bool,
    pub allow_out: &'a [String],
    pub deny_out: &'a [String],
    /// Strict egress (`egress_mode` "sni"): TCP to 80/443 via the proxy.
    pub strict_egress: bool,
    /// Egress rules (`egress_rules`): every TCP flow to 80/443 the policy
    /// lets out goes to the proxy (`DP_F_RULES`).
    pub egress_rules: bool,
    /// The rules' hosts count as allow names (learned by the resolver):
    /// the sandbox has domain rules even when allow_out names none.
    pub rule_names: bool,
    /// Bandwidth limits (0 = unlimited).
    pub bandwidth: crate::types::Bandwidth,
    /// Paused: packets for the sandbox are dropped; the first one of each
    /// pause is reported (`Datapath::wakes`).
    pub paused: bool,
    /// Its port mappings win over host sockets that bind their ports later
    /// (`DP_PM_WINS`: portmap's order, for runtimes that hold the published
    /// port themselves); false: a host socket wins new flows.
    pub mapping_wins: bool,
}

impl SandboxPath<'_> {
    /// Whether the sandbox's IPv6 may reach the world
    /// ([`crate::types::ipv6_open`]).
    pub fn ipv6_egress(&self) -> bool {
        crate::types::ipv6_open(self.allow_internet_access, self.allow_out, self.deny_out)
    }

    /// Whether `allow_out` or `deny_out` has a domain pattern.
    pub fn has_domain_rules(&self) -> bool {
        self.allow_out
            .iter()
            .chain(self.deny_out)
            .any(|e| crate::types::is_domain_entry(e))
            || self.rule_names
    }
}

/// One line of Health: (name, ok, detail).
pub type Check = (String, bool, String);

/// Priority (and handle) of every filter the datapath attaches: an
/// upgrade replaces the filter at the same priority and handle in place.
pub const FILTER_PRIORITY: u16 = 1;

/// Where one of the datapath's programs runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// A bpf filter on the device's own clsact hook (node devices).
    Filter(TcHook),
    /// The bpf filter of a shared tc block (`from_guest`, for every TAP and
    /// veth at once); `Hook::ifindex` is `BLOCK_IFINDEX`.
    Block(u32),
    /// The device's clsact ingress hook bound to the shared block (a TAP or
    /// veth, and the anchor device that keeps the block alive).
    Bound(u32),
}

/// `Hook::ifindex` of a block's filter (the kernel's TCM_IFINDEX_MAGIC_BLOCK).
pub const BLOCK_IFINDEX: u32 = u32::MAX;

/// What the datapath keeps attached in the kernel: the kernel is the truth
/// (an admin or another tool may remove a qdisc or a filter); recovery,
/// Reconcile and Health compare it with this (`Datapath::check`) and attach
/// again (`Datapath::reattach`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    pub device: String,
    pub ifindex: u32,
    pub place: Place,
    pub program: &'static str,
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.place {
            Place::Filter(hook) => write!(f, "{} on {} {hook}", self.program, self.device),
            Place::Block(b) => write!(f, "{} on tc block {b}", self.program),
            Place::Bound(b) => write!(
                f,
                "{} on {} ingress (bound to tc block {b})",
                self.program, self.device
            ),
        }
    }
}

/// A sandbox device's counters: `maps::SB_COUNTER_NAMES`, then
/// `maps::SB_COUNTER_NAMES_IPV6`, then `maps::RATE_COUNTER_NAMES`.
pub type SandboxCounters = [u64; COUNTERS];

/// How many counters a sandbox has: the datapath's by reason and kind,
/// their IPv6 parts, its IPv6 frames ([`maps::TRAFFIC6_NAMES`]), then its
/// pacing counters, in that order.
pub const COUNTERS: usize =
    2 * maps::SB_COUNTER_NAMES.len() + maps::TRAFFIC6_NAMES.len() + maps::RATE_COUNTER_NAMES.len();

/// The datapath's reports of the first packet for each paused sandbox
/// (a ring buffer the programs fill; pollable through its fd).
pub struct WakeRing(pub(crate) aya::maps::RingBuf<aya::maps::MapData>);

impl WakeRing {
    /// Every report waiting in the ring, each with its sender's IPv6
    /// address when it has one (`struct dp_wake6`).
    pub fn drain(&mut self) -> Vec<(maps::DpWake, Option<std::net::Ipv6Addr>)> {
        let mut out = vec![];
        while let Some(item) = self.0.next() {
            if item.len() >= std::mem::size_of::<maps::DpWake>() {
                // SAFETY: the ring holds `struct dp_wake` records (32
                // bytes, checked above), written by `paused_drop`, or
                // `struct dp_wake6` ones (the same 32 bytes first);
                // DpWake is its #[repr(C)] twin, valid for every bit
                // pattern, and read unaligned.
                let w: maps::DpWake = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                let at = std::mem::size_of::<maps::DpWake>();
                let v6 = item
                    .get(at..at + 16)
                    .and_then(|b| <[u8; 16]>::try_from(b).ok())
                    .map(std::net::Ipv6Addr::from);
                out.push((w, v6));
            }
        }
        out
    }
}

impl std::os::fd::AsRawFd for WakeRing {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// The flow log's share of the `flow_events` ring per sandbox: events per
/// second on average, and at once (`dp_config.flow_interval_ns`,
/// `flow_burst`). A flood of refused packets from one sandbox costs the
/// ring this many events a second, however fast it sends.
pub const FLOW_EVENTS_PER_SEC: u32 = 200;
pub const FLOW_EVENTS_BURST: u32 = 400;

/// The datapath's flow events (`flow_events` ring), as the agent reads
/// them (`agent/flows.rs`).
pub struct FlowRing(pub(crate) aya::maps::RingBuf<aya::maps::MapData>);

impl FlowRing {
    /// The events committed so far.
    pub fn drain(&mut self, out: &mut Vec<maps::DpFlowEvent>) {
        while let Some(item) = self.0.next() {
            if item.len() >= std::mem::size_of::<maps::DpFlowEvent>() {
                // SAFETY: the ring holds `struct dp_flow_event` records
                // (120 bytes, checked above) written by `flow_note`;
                // DpFlowEvent is its #[repr(C)] twin, valid for every bit
                // pattern, and read unaligned.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) });
            }
        }
    }
}

impl std::os::fd::AsRawFd for FlowRing {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// A world flow (`ct`, `ct6`) as the flow log names it: the sandbox, the
/// family (4, 6), protocol, the guest's port, the remote and its port
/// (ports in host order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowId {
    pub sandbox_ip: std::net::Ipv4Addr,
    pub proto: u8,
    pub guest_port: u16,
    pub remote: std::net::IpAddr,
    pub remote_port: u16,
}

/// A world flow's end, as the reaper found it: closed (TCP: an RST, or a
/// FIN each way), expired, or its sandbox released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowEnd {
    pub id: FlowId,
    pub generation: u64,
    /// `DP_CT_SNAT` (the sandbox opened it) or `DP_CT_PORTMAP`.
    pub kind: u8,
    /// The SNAT port, or the mapping's host port (host order).
    pub node_port: u16,
    /// IPv6: the guest's address was its fixed one (`DP_GADDR_FIXED`).
    pub guest_fixed6: bool,
    /// Monotonic ns of the first and last packet seen.
    pub start_ns: u64,
    pub last_ns: u64,
    pub bytes_out: u64,
    pub pkts_out: u64,
    pub bytes_in: u64,
    pub pkts_in: u64,
}

/// A host <-> sandbox flow (`hflow`) the reaper saw start or end: the
/// node's end of it (address and port as the node sends them; IPv6: the
/// words of the sandboxes' /96 in the addresses), the guest's port and the
/// port the guest sees on its gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFlow {
    pub start: bool,
    pub sandbox_ip: std::net::Ipv4Addr,
    pub ipv6: bool,
    pub proto: u8,
    /// The node (or a local process) opened it; else the guest did.
    pub node_opened: bool,
    pub node: std::net::Ipv4Addr,
    pub node_port: u16,
    pub guest_port: u16,
    pub gw_port: u16,
    /// Monotonic ns of the pass that saw it.
    pub seen_ns: u64,
}

/// Flow ends kept for the agent between two of its reads (it reads every
/// second; the reaper adds every 2 s): beyond, the oldest are dropped.
pub const FLOW_ENDS_MAX: usize = 65_536;

pub trait Datapath: Send + Sync {
    /// Every sandbox device's flow-log events emitted and lost so far
    /// (ifindex, sent, lost).
    fn flow_event_counts(&self) -> Vec<(u32, u64, u64)> {
        Vec::new()
    }
    /// The world flows' ends the reaper found since the last call.
    fn take_flow_ends(&self) -> Vec<FlowEnd> {
        Vec::new()
    }
    /// The host <-> sandbox flows the reaper saw start or end since the
    /// last call.
    fn take_host_flows(&self) -> Vec<HostFlow> {
        Vec::new()
    }
    /// The flow log's events, once (None: taken already, or a datapath
    /// without them).
    fn flow_ring(&self) -> Option<FlowRing> {
        None
    }
    /// Turns the flow log's events and deny_action "reject" on or off.
    fn set_flow_log(&self, _events: bool, _reject: bool) -> Result<(), DatapathError> {
        Ok(())
    }
    /// The reports of traffic for paused sandboxes, once (None: taken
    /// already, or a datapath without them).
    fn wake_ring(&self) -> Option<WakeRing> {
        None
    }
    /// Installs or replaces the sandbox's datapath state (idempotent).
    fn attach(&self, sandbox: &SandboxPath<'_>) -> Result<(), DatapathError>;
    /// Removes every entry of the sandbox; missing entries are not an error.
    fn detach(&self, sandbox: &SandboxPath<'_>) -> Result<(), DatapathError>;
    /// Health checks of the datapath itself.
    fn checks(&self) -> Vec<Check>;
    /// Periodic housekeeping (expired flows); called every few seconds.
    fn maintain(&self) {}
    /// The sandbox's live flows (NAT'ed and port-mapped), as of the last
    /// `maintain` pass.
    fn live_flows(&self, _sandbox_ip: std::net::Ipv4Addr) -> u64 {
        0
    }
    /// A sandbox device's own datapath counters, laid out as
    /// [`SandboxCounters`] (None: no entry, e.g. no eBPF datapath).
    fn sandbox_counters(&self, _ifindex: u32) -> Option<Vec<u64>> {
        None
    }
    /// The shaper class the sandbox on `ifindex` sends bulk traffic to
    /// the world through (its egress limit), as an `skb->priority`; None:
    /// it has no egress limit. The agent's own sockets that carry the
    /// sandbox's traffic out (strict mode's proxy) set it, and `to_uplink`
    /// sends such packets through the shaper.
    fn egress_class(&self, _ifindex: u32) -> Option<u32> {
        None
    }
    /// Lets the sandbox start flows to each address until its time to
    /// live is over (the resolver learned them for an allowed name).
    fn learn(
        &self,
        _sandbox_ip: std::net::Ipv4Addr,
        _addrs: &[(IpAddr, std::time::Duration)],
    ) -> Result<(), DatapathError> {
        Ok(())
    }
    /// Every learned address of the addresses' current owners as
    /// (sandbox, destination, time left for new flows); entries of earlier
    /// owners are removed on the way.
    fn learned_entries(&self) -> Vec<(std::net::Ipv4Addr, IpAddr, std::time::Duration)> {
        vec![]
    }
    /// The address and port the guest dialled for a flow the datapath
    /// steered to the agent's proxy: `local` is the proxy's side of the
    /// accepted connection, `guest` the sandbox's (the host flow's key; an
    /// IPv6 one is keyed by the IPv4 words its addresses end with). `None`
    /// when no such flow is recorded.
    fn proxy_peer(
        &self,
        _local: std::net::SocketAddr,
        _guest: std::net::SocketAddr,
    ) -> Option<std::net::SocketAddr> {
        None
    }
    /// Takes learned addresses back: flows to them stop too.
    fn forget(&self, _sandbox_ip: std::net::Ipv4Addr, _addrs: &[IpAddr]) {}
    /// Every sandbox device's counters (one batched dump).
    fn all_sandbox_counters(&self) -> std::collections::HashMap<u32, SandboxCounters> {
        Default::default()
    }
    /// (sandbox flows, host flows) as of the last `maintain` pass.
    fn flow_counts(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Whether it can enforce (egress, ingress) bandwidth limits.
    fn shapes(&self) -> (bool, bool) {
        (false, false)
    }
    /// Live SNAT flows as of the last `maintain` pass.
    fn snat_flows(&self) -> u64 {
        0
    }

    /// The node-wide event and drop counters (name, packets).
    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![]
    }
    /// Prepares a freshly created (idle) TAP off the caller's path, e.g.
    /// attaches the per-TAP program, so EnsureNetwork does not pay for it.
    fn prepare_tap(&self, _tap_name: &str, _tap_ifindex: u32) -> Result<(), DatapathError> {
        Ok(())
    }
    /// [`Datapath::prepare_tap`] for a TAP nobody but the agent ever held
    /// (an idle pool TAP): a qdisc of another kind may be replaced, as no
    /// traffic can be on it.
    fn prepare_idle_tap(&self, tap_name: &str, tap_ifindex: u32) -> Result<(), DatapathError> {
        self.prepare_tap(tap_name, tap_ifindex)
    }
    /// What this datapath keeps attached for the node: filters on node
    /// devices (uplink, lo, the gateway device), the shared block's filter
    /// and the anchor device's binding.
    fn node_hooks(&self) -> Vec<Hook> {
        vec![]
    }
    /// What it keeps on a sandbox or pool TAP (or veth), if anything.
    fn tap_hook(&self, _tap_name: &str, _tap_ifindex: u32) -> Option<Hook> {
        None
    }
    /// Asks the kernel about `hooks` (a few dumps for all of them): the
    /// index and what is wrong of each hook that is missing or runs a
    /// program other than this build's.
    fn check(&self, _hooks: &[Hook]) -> Result<Vec<(usize, String)>, DatapathError> {
        Ok(vec![])
    }
    /// Attaches `hook` again after the kernel lost it (or replaces an
    /// older build's program there in place); idempotent.
    fn reattach(&self, _hook: &Hook) -> Result<(), DatapathError> {
        Ok(())
    }
    /// This build's programs and their tags (what `bpftool prog` shows).
    fn program_tags(&self) -> Vec<(&'static str, u64)> {
        vec![]
    }
    /// TAPs and veths running `from_guest`: (bound to the shared block,
    /// with an older build's qdisc and filter of their own).
    fn tap_counts(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Devices still running another build's program (their filter could
    /// not be replaced at load).
    fn stale(&self) -> Vec<String> {
        vec![]
    }
    /// The kernel announced that a qdisc or filter on `ifindex` was removed
    /// (or the agent deleted the device): forget any belief that it still
    /// carries our filter, so the next attach installs it again.
    fn forget_attachment(&self, _ifindex: u32) {}
    /// The uplink's NAT66 address changed (`None`: no IPv6 egress any
    /// more): the programs use it from the next packet on.
    fn set_uplink6(&self, _addr: Option<std::net::Ipv6Addr>) -> Result<(), DatapathError> {
        Ok(())
    }
    /// The node's own addresses now (every device's, both families): a
    /// sandbox's packet to one never leaves by the uplink. Returns how
    /// many entries changed.
    fn set_node_addrs(&self, _addrs: &[std::net::IpAddr]) -> Result<usize, DatapathError> {
        Ok(0)
    }
}

/// A datapath that programs nothing: TAPs, addresses, neighbour entries and
/// records are managed, packets are left to the host's own routing. Used
/// for `datapath = "none"`, and when the eBPF datapath could not be loaded
/// (then Health is not ok and says why).
#[derive(Debug)]
pub struct NoopDatapath {
    ok: bool,
    detail: String,
}

impl NoopDatapath {
    /// `datapath = "none"`, chosen by the operator.
    pub fn configured() -> Self {
        Self {
            ok: true,
            detail: "none (datapath = \"none\"): sandboxes get TAP, address and neighbour only"
                .into(),
        }
    }

    /// The eBPF datapath was configured but failed to load.
    pub fn failed(reason: &str) -> Self {
        Self {
            ok: false,
            detail: format!("eBPF datapath not loaded, sandboxes have no connectivity: {reason}"),
        }
    }
}

impl Datapath for NoopDatapath {
    fn attach(&self, _sandbox: &SandboxPath<'_>) -> Result<(), DatapathError> {
        Ok(())
    }

    fn detach(&self, _sandbox: &SandboxPath<'_>) -> Result<(), DatapathError> {
        Ok(())
    }

    fn checks(&self) -> Vec<Check> {
        vec![("datapath".into(), self.ok, self.detail.clone())]
    }
}
