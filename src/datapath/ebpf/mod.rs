//! The eBPF datapath: `ebpf/datapath.bpf.c` loaded once per agent with
//! aya, programs shared by every TAP, maps pinned in a per-instance bpffs
//! directory so they — and the filters, which outlive the agent — carry
//! running flows across agent restarts.
//!
//! Attach model (docs/datapath.md): `from_guest` is the one filter of a
//! shared tc ingress block; every TAP (and CNI veth host end) joins the
//! datapath by creating its clsact qdisc bound to that block — a flat
//! ~0.1 ms, where a qdisc and filter of its own per TAP cost more with
//! every TAP on the node. A persistent, down TAP (`tc_block_anchor`) keeps
//! the block alive with no sandbox on the node. The node programs are
//! filters on the uplink, lo and the gateway device.
//!
//! Upgrade in place: every filter is created or **replaced** at the same
//! priority and handle (`tc.rs`), so a new build's programs take over the
//! block (every bound TAP at once) and each node hook atomically, before
//! READY, with no moment without a program. TAPs an older build gave a
//! qdisc and filter of their own keep them, with this build's program put
//! in place, until they are recycled. Pinned maps are reused, migrated or
//! refused by layout (`pins.rs`). Filters are never detached (not even when
//! a TAP goes back to the pool: `from_guest` drops everything from a TAP
//! with no `sandboxes` entry); `tap_attached` records which devices are
//! bound so the ensure path does not ask the kernel. The kernel stays the
//! truth: recovery, Reconcile and Health compare it with [`Datapath::check`]
//! and the agent's RTNLGRP_TC watcher forgets a device's binding as soon as
//! the kernel announces a qdisc or filter removal on it.
//!
//! Rooms: `load.rs` (object, programs, pins, the switch), `attach.rs`
//! (tc block and filters, `check`), `entries.rs` (a sandbox's map entries,
//! transactional), `learned.rs` (DNS-learned addresses), `reap.rs` (the
//! flow reaper and host-flow shares), `health.rs` (what Health is told).
//! This file holds the state they share and the `Datapath` trait's face.

use std::collections::{HashMap as StdHashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap};
use aya::programs::{ProgramFd, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use tracing::{debug, info, warn};

use super::maps::*;
use super::pins::{dump_flows, dump_per_cpu};
use super::shaper;
use super::tc::{self, Target};
use super::{
    BLOCK_IFINDEX, Check, Datapath, DatapathError, FILTER_PRIORITY, Hook, Place, SandboxPath,
};
use crate::alloc::Protocol;
use crate::netlink::TcHook;

mod attach;
mod entries;
mod health;
mod learned;
mod load;
mod node_addrs;
mod policy;
mod reap;

use attach::*;
use entries::*;
use policy::{Added, Policies, Wanted};

pub use health::check_cases;

/// Handle of every filter (with [`FILTER_PRIORITY`]).
const FILTER_HANDLE: u32 = 1;

/// The programs, in the order they load.
pub const PROGRAMS: [&str; 13] = [
    "from_guest",
    "from_uplink",
    "to_sandbox_ip",
    "from_host",
    "to_uplink",
    "from_shaper",
    // Reached by tail call (`tails`), attached nowhere.
    "guest6_out",
    "uplink6_in",
    "guest6_rst",
    "icmp6_error",
    "guest6_steer",
    "uplink6_frag",
    "host_to_sandbox6",
];

/// The shaper device's peer is named after it with this suffix.
pub const SHAPER_PEER_SUFFIX: &str = "-r";

/// `tap_attached` values: how a TAP or veth carries `from_guest`.
const BOUND: u32 = 2;

/// A qdisc and filter of its own (attached by a build before the shared
/// block; aya wrote 1).
const OWN_FILTER: u32 = 1;

/// Idle timeouts of flows (the reaper frees them; LRU maps also evict
/// under pressure).
#[derive(Debug, Clone, Copy)]
pub struct FlowTimeouts {
    pub tcp: Duration,
    pub tcp_closing: Duration,
    pub udp: Duration,
    pub icmp: Duration,
}

impl FlowTimeouts {
    /// How long a flow of `proto` in TCP state `state` may stay idle (any
    /// FIN or RST: the closing timeout).
    fn limit(&self, proto: u8, state: u8) -> Duration {
        match proto as i32 {
            libc::IPPROTO_TCP if state & DP_TCP_REMOTE_TW != 0 => {
                self.tcp_closing.max(REMOTE_TIME_WAIT)
            }
            libc::IPPROTO_TCP if state != 0 => self.tcp_closing,
            libc::IPPROTO_TCP => self.tcp,
            libc::IPPROTO_UDP => self.udp,
            _ => self.icmp,
        }
    }
}

/// Node facts the datapath needs.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub guest_ip: Ipv4Addr,
    pub gateway_ip: Ipv4Addr,
    pub host_ip: Ipv4Addr,
    pub guest_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    pub gwdev_name: String,
    pub gwdev_ifindex: u32,
    pub gwdev_mac: [u8; 6],
    /// (name, ifindex, IPv4 address) of the uplink, if there is one.
    pub uplink: Option<(String, u32, Ipv4Addr)>,
    pub snat_ports: (u16, u16),
    pub pin_dir: PathBuf,
    pub timeouts: FlowTimeouts,
    /// The shared tc block of every TAP's ingress.
    pub block: u32,
    /// (name, ifindex) of the device that keeps the block alive.
    pub anchor: (String, u32),
    /// How the host-flow tables are shared between sandboxes.
    pub hflow_shares: HflowShares,
    /// uids besides root whose processes may open flows to sandbox
    /// addresses.
    pub host_access_uids: Vec<u32>,
    /// (name, ifindex) of the shaper device (egress limits: HTB at its
    /// root), and its peer's ifindex (`from_shaper` on its ingress).
    pub shaper: Option<(String, u32)>,
    pub shaper_peer: Option<u32>,
    /// The guests' IPv6 link (RA, NA, fast refusal): config `ipv6`.
    pub ipv6_link: bool,
    /// The flow log's events (config `flow_events`) and deny_action
    /// "reject" (`DP_CFG_FLOW_EVENTS`, `DP_CFG_REJECT`).
    pub flow_events: bool,
    pub deny_reject: bool,
    /// NAT66 (with `ipv6_link`): the uplink's global IPv6 address, when it
    /// has one and the node an IPv6 default route out of it.
    pub uplink_ip6: Option<std::net::Ipv6Addr>,
    /// Host <-> sandbox over IPv6 (with `ipv6_link`): the /96 of the
    /// sandboxes' IPv6 identities, routed to the gateway device.
    pub pool6: Option<[u8; 12]>,
    /// The sandbox pool's netmask (the pool is `host_ip`'s network).
    pub pool_mask: Ipv4Addr,
    /// The node's own addresses now (both families): what `node_addrs`
    /// holds before the programs run.
    pub node_addrs: Vec<std::net::IpAddr>,
}

fn ip_be(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

fn err(what: &'static str, e: impl std::fmt::Display) -> DatapathError {
    DatapathError {
        what,
        detail: e.to_string(),
        fatal: false,
    }
}

fn tc_err(what: &'static str, target: impl std::fmt::Display, e: std::io::Error) -> DatapathError {
    err(what, format!("{target}: {e}"))
}

/// This build's programs by name (fds: pinned or not, they stay loaded).
type Programs = StdHashMap<&'static str, ProgramFd>;

/// A loaded program's tag (what it is) and id (which one).
#[derive(Debug, Clone, Copy)]
struct ProgId {
    tag: u64,
    id: u32,
}

struct Maps {
    config: Array<MapData, DpConfig>,
    counters: PerCpuArray<MapData, u64>,
    sandboxes: HashMap<MapData, u32, DpSandbox>,
    by_ip: HashMap<MapData, u32, DpTap>,
    portmap: HashMap<MapData, DpPortmapKey, DpPortmapVal>,
    attached: HashMap<MapData, u32, u32>,
    sb_stats: HashMap<MapData, u32, DpSbStats>,
    sb_traffic6: PerCpuHashMap<MapData, u32, DpTraffic6>,
    sb_share: HashMap<MapData, u32, DpShare>,
    sb_rate: HashMap<MapData, u32, DpRate>,
    /// The first packet of each pause, per device: emptied to arm a pause.
    wake_sent: HashMap<MapData, u32, DpWake>,
    /// The node's own addresses (`set_node_addrs`).
    node_addrs: HashMap<MapData, u32, u8>,
    node_addrs6: HashMap<MapData, [u8; 16], u8>,
}

struct Inner {
    maps: Maps,
    /// The CIDR rules' tries of each family.
    policy4: Policies<DpPolicyData>,
    policy6: Policies<DpPolicy6Data>,
    /// sandbox ip -> port-map keys installed for it.
    portmaps: StdHashMap<u32, Vec<DpPortmapKey>>,
}

/// The reaper's own handles on the pinned maps, so walking tens of
/// thousands of flows never holds the lock `attach` needs on the ensure
/// path (map operations are safe to run concurrently in the kernel).
struct Reaper {
    ct: HashMap<MapData, DpCtKey, DpCtVal>,
    ct_rev: HashMap<MapData, DpRevKey, DpRevVal>,
    attached: HashMap<MapData, u32, u32>,
    /// Read only: which generation owns each address now.
    by_ip: HashMap<MapData, u32, DpTap>,
    /// `by_ip` and `tap_attached` once more, for batched dumps.
    by_ip_dump: MapData,
    attached_dump: MapData,
    /// Passes so far: attachments of gone devices are looked for on
    /// every `reap::GONE_CHECK_EVERY`th (a lookup per device).
    passes: u64,
    /// `ct` once more, for batched dumps (BPF_MAP_LOOKUP_BATCH).
    ct_dump: MapData,
    /// Host connections in the SNAT range (see `to_uplink`).
    host_nat: HashMap<MapData, DpRevKey, DpCtVal>,
    host_nat_dump: MapData,
    /// Host <-> sandbox flows and their guest-side entries.
    hflow: HashMap<MapData, DpHflowKey, DpHflowVal>,
    hflow_dump: MapData,
    hrev: HashMap<MapData, DpHrevKey, DpHrevVal>,
    hrev_dump: MapData,
    /// Each sandbox's share of the host-flow tables (recounted every pass)
    /// and the node-wide pool's.
    sb_share: HashMap<MapData, u32, DpShare>,
    sb_share_dump: MapData,
    share_pool: Array<MapData, DpSharePool>,
    hflow_shares: HflowShares,
    /// Per-sandbox counters: entries of gone devices are removed.
    sb_stats: HashMap<MapData, u32, DpSbStats>,
    sb_dump: MapData,
    sb_traffic6: PerCpuHashMap<MapData, u32, DpTraffic6>,
    traffic6_dump: MapData,
    /// Bandwidth limits: entries of gone devices are removed.
    sb_rate: HashMap<MapData, u32, DpRate>,
    rate_dump: MapData,
    /// Wake reports: entries of gone devices are removed.
    wake_sent: HashMap<MapData, u32, DpWake>,
    /// NAT66 flows, their reverse entries, and `ct6` for batched dumps.
    ct6: HashMap<MapData, DpCt6Key, DpCtVal>,
    ct_rev6: HashMap<MapData, DpRev6Key, DpRevVal>,
    ct6_dump: MapData,
    /// The flow log: flows whose end was reported while their entry lives
    /// on (a closed TCP flow keeps its entry for the closing timeout), by
    /// (key, start): reported once.
    /// The value: the pass that last saw it.
    ended: StdHashMap<(super::FlowId, u64), u64>,
    /// The flow log: host flows seen by the last pass (and the generation
    /// that owned them): one missing from a pass has ended, a new one
    /// started.
    /// (generation, the flow, its end recorded: a closed TCP flow's
    /// entry lives on for the closing timeout).
    hseen: StdHashMap<DpHflowKey, (u64, super::HostFlow, bool)>,
}

/// Counts refreshed by `maintain`, read by `checks` without touching maps.
#[derive(Default)]
struct Stats {
    /// Live sandbox flows, both families, and of them NAT66's (`ct6`).
    flows: AtomicUsize,
    flows6: AtomicUsize,
    /// Live SNAT flows (each holds a port of the SNAT range for its remote).
    snat_flows: AtomicUsize,
    /// Host <-> sandbox flows and host connections in the SNAT range.
    host_flows: AtomicUsize,
    /// TAPs and veths running `from_guest`, and of those the ones with
    /// an older build's filter of their own.
    taps: AtomicUsize,
    own: AtomicUsize,
    reaped: AtomicU64,
    /// Live sandbox flows per sandbox address (the `ct` key's form).
    by_sandbox: Mutex<StdHashMap<u32, u64>>,
}

pub struct EbpfDatapath {
    inner: Mutex<Inner>,
    progs: Programs,
    reaper: Mutex<Reaper>,
    /// `hflow` once more, for the proxy's lookups of the address a steered
    /// flow dialled (no lock: a lookup is one syscall).
    proxy_flows: HashMap<MapData, DpHflowKey, DpHflowVal>,
    stats: Stats,
    node: NodeInfo,
    node_hooks: Vec<Hook>,
    /// Tag and id of each program of this build (what `check` compares
    /// with; the ids: what `tails` must hold).
    tags: StdHashMap<&'static str, ProgId>,
    /// `tails`, for Health to read its slots.
    tails_read: MapData,
    /// TAPs and veths that keep an older build's qdisc and filter of their
    /// own (this build's program replaced in place at load).
    own_filter: Mutex<HashSet<u32>>,
    /// Of those, the ones whose filter could not be replaced: they run
    /// another build's program (Health says so until they converge).
    stale: Mutex<Vec<(u32, String)>>,
    /// The kernel announced a removal on the block or its anchor: put
    /// them back before the next TAP joins (see `repair_block_if_lost`).
    block_lost: std::sync::atomic::AtomicBool,
    /// `tap_attached`, for forgetting a device without `inner`.
    attached_forget: MapData,
    /// `sb_stats` for readers (GetNetwork, metrics), without `inner`.
    sb_read: Mutex<HashMap<MapData, u32, DpSbStats>>,
    sb_read_dump: MapData,
    /// `sb_traffic6` likewise.
    traffic6_read: Mutex<PerCpuHashMap<MapData, u32, DpTraffic6>>,
    traffic6_read_dump: MapData,
    /// `sb_rate` likewise (the pacing counters).
    rate_read: Mutex<HashMap<MapData, u32, DpRate>>,
    rate_read_dump: MapData,
    /// Held while the shaper device's root qdisc is checked and made.
    shaper_root: Mutex<()>,
    /// Sandboxes (by device) whose limit could not be set up, and why
    /// (Health's `bandwidth`), until an attach of theirs succeeds.
    shaper_faults: Mutex<std::collections::BTreeMap<u32, String>>,

    /// `dns_learned` and `dns_learned6`, written by the resolver's
    /// answers behind locks of their own (never `inner`, which the ensure
    /// path needs).
    learned: learned::Learned<DpLearnedKey>,
    learned6: learned::Learned<DpLearned6Key>,
    /// `by_ip` for reads without `inner` (the owner's generation), and
    /// for batched dumps.
    by_ip_read: HashMap<MapData, u32, DpTap>,
    by_ip_read_dump: MapData,
    /// Pinned maps migrated or recreated at load (layout changed).
    migrated: Vec<String>,
    /// The config this agent wrote (what `datapath` compares the map with;
    /// rewritten when the uplink's IPv6 address changes).
    config: Mutex<DpConfig>,
    /// The id of the map behind each pin, at load (what `datapath_pins`
    /// compares the pins with).
    pin_ids: Vec<(&'static str, u32)>,
    /// Whether host -> 127.x:host_port mappings can work.
    localnet: Result<(), String>,
    /// The `wakes` ring, until the agent takes it (`Datapath::wake_ring`).
    wakes: Mutex<Option<aya::maps::RingBuf<MapData>>>,
    /// Flow ends the reaper found, until the agent takes them
    /// (`Datapath::take_flow_ends`); at most `FLOW_ENDS_MAX`.
    flow_ends: Mutex<Vec<super::FlowEnd>>,
    /// The same for host flows (`Datapath::take_host_flows`).
    host_flows: Mutex<Vec<super::HostFlow>>,
    /// The `flow_events` ring, until the agent takes it
    /// (`Datapath::flow_ring`).
    flow_events: Mutex<Option<aya::maps::RingBuf<MapData>>>,
}

impl EbpfDatapath {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counters(inner: &Inner) -> Vec<(&'static str, u64)> {
        COUNTER_NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let sum = inner
                    .maps
                    .counters
                    .get(&(i as u32), 0)
                    .map(|v| v.iter().sum())
                    .unwrap_or(0);
                (*name, sum)
            })
            .collect()
    }
}

/// What `take_over_taps` found: devices with a filter of their own, those
/// whose filter could not be replaced (ifindex, why), and how many run
/// `from_guest`.
struct TakenOver {
    own: HashSet<u32>,
    stale: Vec<(u32, String)>,
    kept: usize,
}

/// Every entry of a map: one batched dump (`dump`), else entry by entry
/// (`map`, a kernel without batch lookups).
fn read_all<V: aya::Pod + Default>(
    dump: &MapData,
    map: &Mutex<HashMap<MapData, u32, V>>,
) -> Vec<(u32, V)> {
    dump_flows::<u32, V>(dump).unwrap_or_else(|| {
        map.lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flatten()
            .collect()
    })
}

impl EbpfDatapath {
    /// The IPv6 frames of the sandbox on `ifindex` ([`TRAFFIC6_NAMES`]):
    /// zeros before its first.
    fn traffic6(&self, ifindex: u32) -> [u64; 4] {
        self.traffic6_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .map_or([0; 4], |parts| DpTraffic6::sum(parts.iter()))
    }

    /// Every sandbox's IPv6 frames ([`TRAFFIC6_NAMES`]): one batched dump
    /// of `sb_traffic6`, else entry by entry.
    fn all_traffic6(&self) -> Vec<(u32, [u64; 4])> {
        dump_per_cpu(&self.traffic6_read_dump, |parts: &[DpTraffic6]| {
            DpTraffic6::sum(parts)
        })
        .unwrap_or_else(|| {
            self.traffic6_read
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .flatten()
                .map(|(i, parts)| (i, DpTraffic6::sum(parts.iter())))
                .collect()
        })
    }

    /// Every `sb_rate` entry (the sandboxes with a limit).
    fn rates(&self) -> Vec<(u32, DpRate)> {
        read_all(&self.rate_read_dump, &self.rate_read)
    }
}

/// A sandbox's shaper counters in `maps::RATE_COUNTER_NAMES` order, from
/// its two leaves on the uplink (egress) and on its device (ingress).
fn rate_counters(
    egress: shaper::ClassStats,
    ingress: shaper::ClassStats,
) -> [u64; RATE_COUNTER_NAMES.len()] {
    [
        egress.packets,
        egress.bytes,
        egress.overlimits,
        egress.drops,
        ingress.packets,
        ingress.bytes,
        ingress.overlimits,
        ingress.drops,
    ]
}

pub(crate) fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

impl Datapath for EbpfDatapath {
    fn wake_ring(&self) -> Option<super::WakeRing> {
        self.wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(super::WakeRing)
    }

    /// Transactional (`entries.rs`).
    fn attach(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        self.write_sandbox(sb)
    }

    fn prepare_tap(&self, _tap_name: &str, tap_ifindex: u32) -> Result<(), DatapathError> {
        let mut guard = self.lock();
        self.ensure_filter(&mut guard, tap_ifindex)
    }

    fn prepare_idle_tap(&self, _tap_name: &str, tap_ifindex: u32) -> Result<(), DatapathError> {
        let mut guard = self.lock();
        self.join(&mut guard, tap_ifindex, true)
    }

    fn node_hooks(&self) -> Vec<Hook> {
        self.node_hooks.clone()
    }

    fn tap_hook(&self, tap_name: &str, tap_ifindex: u32) -> Option<Hook> {
        let own = self
            .own_filter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&tap_ifindex);
        Some(Hook {
            device: tap_name.to_owned(),
            ifindex: tap_ifindex,
            place: if own {
                Place::Filter(TcHook::Ingress)
            } else {
                Place::Bound(self.node.block)
            },
            program: "from_guest",
        })
    }

    /// Compared by program tag with this build's (`attach.rs`).
    fn check(&self, hooks: &[Hook]) -> Result<Vec<(usize, String)>, DatapathError> {
        self.check_hooks(hooks)
    }

    fn reattach(&self, hook: &Hook) -> Result<(), DatapathError> {
        let tap = hook.program == "from_guest"
            && !matches!(hook.place, Place::Block(_))
            && hook.ifindex != self.node.anchor.1;
        if tap {
            let mut guard = self.lock();
            self.join(&mut guard, hook.ifindex, false)?;
        } else {
            install(&self.progs, hook)?;
        }
        info!(%hook, "datapath hook attached again");
        Ok(())
    }

    fn forget_attachment(&self, ifindex: u32) {
        if ifindex == BLOCK_IFINDEX || ifindex == self.node.anchor.1 {
            self.block_lost.store(true, Ordering::Release);
        }
        super::pins::delete_u32(&self.attached_forget, ifindex);
        self.own_filter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ifindex);
    }

    fn program_tags(&self) -> Vec<(&'static str, u64)> {
        PROGRAMS.iter().map(|p| (*p, self.tags[p].tag)).collect()
    }

    fn egress_class(&self, ifindex: u32) -> Option<u32> {
        self.rate_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .ok()
            .map(|r| r.out_bulk)
            .filter(|&c| c != 0)
    }

    fn set_node_addrs(&self, addrs: &[std::net::IpAddr]) -> Result<usize, DatapathError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let maps = &mut inner.maps;
        node_addrs::sync(&mut maps.node_addrs, &mut maps.node_addrs6, addrs)
    }

    fn set_flow_log(&self, events: bool, reject: bool) -> Result<(), DatapathError> {
        let mut inner = self.lock();
        let mut cfg = self.config.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = *cfg;
        next.flags &= !(DP_CFG_FLOW_EVENTS | DP_CFG_REJECT);
        if events {
            next.flags |= DP_CFG_FLOW_EVENTS;
        }
        if reject {
            next.flags |= DP_CFG_REJECT;
        }
        if next != *cfg {
            inner
                .maps
                .config
                .set(0, next, 0)
                .map_err(|e| map_err("writing the config map (the flow log)", &e))?;
            *cfg = next;
        }
        Ok(())
    }

    fn flow_event_counts(&self) -> Vec<(u32, u64, u64)> {
        read_all(&self.sb_read_dump, &self.sb_read)
            .into_iter()
            .map(|(i, s)| (i, s.flow_sent, s.flow_lost))
            .collect()
    }

    fn take_host_flows(&self) -> Vec<super::HostFlow> {
        std::mem::take(&mut *self.host_flows.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn take_flow_ends(&self) -> Vec<super::FlowEnd> {
        std::mem::take(&mut *self.flow_ends.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn flow_ring(&self) -> Option<super::FlowRing> {
        self.flow_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(super::FlowRing)
    }

    fn set_uplink6(&self, addr: Option<std::net::Ipv6Addr>) -> Result<(), DatapathError> {
        /// Between two config writes: longer than any packet's run of the
        /// programs (microseconds) by far.
        const UPLINK6_SETTLE: Duration = Duration::from_millis(5);
        let mut inner = self.lock();
        let mut cfg = self.config.lock().unwrap_or_else(|p| p.into_inner());
        if cfg.flags & DP_CFG_IPV6 == 0 {
            return Ok(());
        }
        // In steps, so that no packet reads a half-written address as
        // NAT66's (`DpConfig::uplink6_steps`); a change of address blocks
        // IPv6 egress for ~2 × UPLINK6_SETTLE (its flows end anyway).
        for (i, next) in cfg.uplink6_steps(addr).into_iter().enumerate() {
            if i > 0 {
                std::thread::sleep(UPLINK6_SETTLE);
            }
            inner
                .maps
                .config
                .set(0, next, 0)
                .map_err(|e| map_err("writing the config map (the uplink's IPv6 address)", &e))?;
            *cfg = next;
        }
        Ok(())
    }

    fn tap_counts(&self) -> (usize, usize) {
        let own = self.stats.own.load(Ordering::Relaxed);
        let taps = self.stats.taps.load(Ordering::Relaxed);
        (taps.saturating_sub(own), own)
    }

    fn stale(&self) -> Vec<String> {
        self.stale
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(_, s)| s.clone())
            .collect()
    }

    fn learn(
        &self,
        sandbox_ip: Ipv4Addr,
        addrs: &[(IpAddr, Duration)],
    ) -> Result<(), DatapathError> {
        self.learn_addrs(sandbox_ip, addrs)
    }

    fn learned_entries(&self) -> Vec<(Ipv4Addr, IpAddr, Duration)> {
        self.learned_list()
    }

    fn forget(&self, sandbox_ip: Ipv4Addr, addrs: &[IpAddr]) {
        self.forget_addrs(sandbox_ip, addrs)
    }

    fn proxy_peer(
        &self,
        local: std::net::SocketAddr,
        guest: std::net::SocketAddr,
    ) -> Option<std::net::SocketAddr> {
        use std::net::{IpAddr as Ip, SocketAddr};
        // An IPv6 host flow is keyed by the IPv4 words its addresses end
        // with (the gateway's pool6 ‖ host_ip, the sandbox's pool6 ‖
        // sandbox_ip).
        let (family, saddr, daddr) = match (local.ip(), guest.ip()) {
            (Ip::V4(l), Ip::V4(g)) => (DP_HFAM_IPV4, u32::from(l), u32::from(g)),
            (Ip::V6(l), Ip::V6(g)) => {
                let word = |a: std::net::Ipv6Addr| {
                    let o = a.octets();
                    u32::from_be_bytes([o[12], o[13], o[14], o[15]])
                };
                (DP_HFAM_IPV6, word(l), word(g))
            }
            _ => return None,
        };
        let key = DpHflowKey {
            saddr: saddr.to_be(),
            daddr: daddr.to_be(),
            sport: local.port().to_be(),
            dport: guest.port().to_be(),
            proto: libc::IPPROTO_TCP as u8,
            family,
            pad: [0; 2],
        };
        let v = self.proxy_flows.get(&key, 0).ok()?;
        if v.kind != DP_HF_PROXY {
            return None;
        }
        let port = u16::from_be(v.gw_port);
        match family {
            DP_HFAM_IPV4 if v.peer_ip != 0 => Some(SocketAddr::new(
                Ip::V4(Ipv4Addr::from(u32::from_be(v.peer_ip))),
                port,
            )),
            DP_HFAM_IPV6 if v.peer6 != [0; 16] => Some(SocketAddr::new(
                Ip::V6(std::net::Ipv6Addr::from(v.peer6)),
                port,
            )),
            _ => None,
        }
    }

    fn detach(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        self.remove_sandbox(sb)
    }

    fn maintain(&self) {
        self.reap()
    }

    fn flow_counts(&self) -> (u64, u64) {
        (
            self.stats.flows.load(Ordering::Relaxed) as u64,
            self.stats.host_flows.load(Ordering::Relaxed) as u64,
        )
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        Self::counters(&self.lock())
    }

    fn shapes(&self) -> (bool, bool) {
        (
            self.node.uplink.is_some() && self.node.shaper.is_some(),
            true,
        )
    }

    fn snat_flows(&self) -> u64 {
        self.stats.snat_flows.load(Ordering::Relaxed) as u64
    }

    fn sandbox_counters(&self, ifindex: u32) -> Option<Vec<u64>> {
        let mut c = self
            .sb_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .ok()
            .map(|s| [s.c, s.v6].concat())?;
        c.extend(self.traffic6(ifindex));
        let rate = self
            .rate_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .ok();
        let (mut egress, mut ingress) = Default::default();
        if let Some(r) = rate
            && let Ok(mut conn) = tc::Conn::new()
        {
            if r.out_small != 0
                && let Some((_, uplink)) = &self.node.shaper
            {
                for id in [r.out_small, r.out_bulk] {
                    if let Ok(Some(s)) = shaper::one_class(&mut conn, *uplink, id) {
                        egress = s.plus(egress);
                    }
                }
            }
            if r.in_shaped != 0
                && let Ok(all) = shaper::class_stats(&mut conn, ifindex)
            {
                ingress = leaves(&all, TAP_TREE);
            }
        }
        c.extend(rate_counters(egress, ingress));
        Some(c)
    }

    fn all_sandbox_counters(&self) -> StdHashMap<u32, crate::datapath::SandboxCounters> {
        let rates: StdHashMap<u32, DpRate> = self.rates().into_iter().collect();
        // One dump of the uplink's classes, one of each shaped device's.
        let mut shaped: StdHashMap<u32, [u64; RATE_COUNTER_NAMES.len()]> = StdHashMap::new();
        if !rates.is_empty()
            && let Ok(mut conn) = tc::Conn::new()
        {
            let uplink = match &self.node.shaper {
                Some((_, i)) if rates.values().any(|r| r.out_small != 0) => {
                    shaper::class_stats(&mut conn, *i).unwrap_or_default()
                }
                _ => Default::default(),
            };
            for (i, r) in &rates {
                let egress = [r.out_small, r.out_bulk]
                    .iter()
                    .filter_map(|id| uplink.get(id))
                    .fold(shaper::ClassStats::default(), |a, s| a.plus(*s));
                let ingress = if r.in_shaped != 0 {
                    leaves(
                        &shaper::class_stats(&mut conn, *i).unwrap_or_default(),
                        TAP_TREE,
                    )
                } else {
                    Default::default()
                };
                shaped.insert(*i, rate_counters(egress, ingress));
            }
        }
        let traffic6: StdHashMap<u32, [u64; 4]> = self.all_traffic6().into_iter().collect();
        read_all(&self.sb_read_dump, &self.sb_read)
            .into_iter()
            .map(|(i, s)| {
                let mut c = [0; crate::datapath::COUNTERS];
                let (sb, rest) = c.split_at_mut(SB_COUNTER_NAMES.len());
                let (sb6, rest) = rest.split_at_mut(SB_COUNTER_NAMES.len());
                let (t6, rate) = rest.split_at_mut(TRAFFIC6_NAMES.len());
                sb.copy_from_slice(&s.c);
                sb6.copy_from_slice(&s.v6);
                if let Some(t) = traffic6.get(&i) {
                    t6.copy_from_slice(t);
                }
                if let Some(r) = shaped.get(&i) {
                    rate.copy_from_slice(r);
                }
                (i, c)
            })
            .collect()
    }

    fn live_flows(&self, sandbox_ip: Ipv4Addr) -> u64 {
        self.stats
            .by_sandbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip_be(sandbox_ip))
            .copied()
            .unwrap_or(0)
    }

    fn checks(&self) -> Vec<Check> {
        self.health_checks()
    }
}
