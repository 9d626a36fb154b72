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

use std::collections::{HashMap as StdHashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::{ProgramFd, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use tracing::{debug, info, warn};

use super::maps::*;
use super::tc::{self, Target};
use super::{
    BLOCK_IFINDEX, Check, Datapath, DatapathError, FILTER_PRIORITY, Hook, Place, SandboxPath,
};
use crate::alloc::Protocol;
use crate::netlink::TcHook;

/// The compiled object (built by build.rs, committed in ebpf/).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/datapath.bpf.o"));

/// How long a guest's DNS exchange over UDP keeps its host-flow entry
/// when idle (the resolver answers within 3 s or not at all).
const DNS_UDP_IDLE: Duration = Duration::from_secs(10);

/// Handle of every filter (with [`FILTER_PRIORITY`]).
const FILTER_HANDLE: u32 = 1;

/// The programs, in the order they load.
pub const PROGRAMS: [&str; 5] = [
    "from_guest",
    "from_uplink",
    "to_sandbox_ip",
    "from_host",
    "to_uplink",
];

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

fn prog_fd<'a>(progs: &'a Programs, name: &str) -> Result<BorrowedFd<'a>, DatapathError> {
    progs
        .get(name)
        .map(AsFd::as_fd)
        .ok_or_else(|| err("finding the program", name))
}

/// How a device came to run `from_guest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joined {
    /// Its clsact is bound to the shared block.
    Bound,
    /// It has a clsact of its own (an older build's, or one an admin made):
    /// its filter now runs this build's `from_guest`, replaced in place.
    OwnFilter,
}

/// Makes `ifindex` run `from_guest`: creates its clsact qdisc bound to
/// `block`. A device that has a clsact already is never left without a
/// program: bound to `block`, nothing to do; a qdisc of its own gets the
/// filter replaced in place; bound to another block, the qdisc is
/// replaced only if `idle` (the anchor, a pool TAP nobody else ever
/// held), else it is an error (`tc_block` changed under live TAPs).
fn bind(progs: &Programs, ifindex: u32, block: u32, idle: bool) -> Result<Joined, DatapathError> {
    let what = "binding the clsact qdisc to the tc block";
    if tc::add_clsact(ifindex, Some(block)).map_err(|e| tc_err(what, ifindex, e))? {
        return Ok(Joined::Bound);
    }
    match tc::clsact_of(ifindex).map_err(|e| tc_err(what, ifindex, e))? {
        Some(Some(b)) if b == block => Ok(Joined::Bound),
        Some(None) if !idle => {
            let target = Target::Device {
                ifindex,
                hook: TcHook::Ingress,
            };
            tc::replace_filter(
                target,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                prog_fd(progs, "from_guest")?,
                "from_guest",
            )
            .map_err(|e| tc_err("attaching the tc filter", ifindex, e))?;
            Ok(Joined::OwnFilter)
        }
        Some(Some(b)) if !idle => Err(err(
            what,
            format!(
                "ifindex {ifindex} is bound to tc block {b}, not {block} (was tc_block changed \
                 while sandboxes ran? their TAPs keep block {b} until they are released)"
            ),
        )),
        // Idle, or a qdisc that went meanwhile: nothing runs there.
        _ => {
            tc::del_clsact(ifindex).map_err(|e| tc_err(what, ifindex, e))?;
            if tc::add_clsact(ifindex, Some(block)).map_err(|e| tc_err(what, ifindex, e))? {
                Ok(Joined::Bound)
            } else {
                Err(err(
                    what,
                    format!("ifindex {ifindex} has an ingress qdisc that is not a clsact"),
                ))
            }
        }
    }
}

/// Puts `h` in the kernel: binds a device, or creates (or replaces in
/// place) a filter with this build's program.
fn install(progs: &Programs, h: &Hook) -> Result<(), DatapathError> {
    let target = match h.place {
        // Only the anchor is installed this way (TAPs: `ensure_filter`).
        Place::Bound(block) => return bind(progs, h.ifindex, block, true).map(|_| ()),
        Place::Block(block) => Target::Block(block),
        Place::Filter(hook) => {
            tc::add_clsact(h.ifindex, None)
                .map_err(|e| tc_err("adding the clsact qdisc", &h.device, e))?;
            Target::Device {
                ifindex: h.ifindex,
                hook,
            }
        }
    };
    tc::replace_filter(
        target,
        FILTER_PRIORITY,
        FILTER_HANDLE,
        prog_fd(progs, h.program)?,
        h.program,
    )
    .map_err(|e| tc_err("attaching the tc filter", h, e))
}

/// The ingress binding of every `Place::Bound` hook (None for the others),
/// a request per device on two sockets in parallel when there are many:
/// linear in the devices, where a dump of every qdisc is quadratic.
fn ingress_bindings(hooks: &[Hook]) -> Result<Vec<Option<tc::Binding>>, DatapathError> {
    let ask = |part: &[Hook]| -> std::io::Result<Vec<Option<tc::Binding>>> {
        if !part.iter().any(|h| matches!(h.place, Place::Bound(_))) {
            return Ok(vec![None; part.len()]);
        }
        let mut conn = tc::Conn::new()?;
        part.iter()
            .map(|h| match h.place {
                Place::Bound(_) => conn.ingress_binding(h.ifindex).map(Some),
                _ => Ok(None),
            })
            .collect()
    };
    let r = if hooks.len() > 512 {
        let (a, b) = hooks.split_at(hooks.len() / 2);
        std::thread::scope(|sc| {
            let other = sc.spawn(|| ask(b));
            let mut first = ask(a)?;
            first.extend(
                other
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))?,
            );
            Ok(first)
        })
    } else {
        ask(hooks)
    };
    r.map_err(|e| err("asking the TAPs' ingress filters", e))
}

/// What is wrong with the datapath's filter on `target`, if anything.
fn filter_drift(target: Target, program: &str, tag: u64) -> std::io::Result<Option<String>> {
    let filters = tc::bpf_filters(target)?;
    Ok(
        match filters.iter().find(|f| f.priority == FILTER_PRIORITY) {
            None => Some("no bpf filter".into()),
            Some(f) if f.tag == tag => None,
            Some(f) => Some(format!(
                "runs {} tag {:016x} (id {}), not this build's {program} tag {tag:016x}",
                if f.name.is_empty() {
                    "a program"
                } else {
                    &f.name
                },
                f.tag,
                f.id
            )),
        },
    )
}

/// Names this build's programs in the pin directory: a hash (FNV-1a) of
/// the object they come from.
fn build_id() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in OBJECT {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// This build's programs as an earlier start of the same build pinned
/// them, if all are there and use exactly the maps pinned now: a restart
/// of the same build then skips the verifier (~1 s for these programs).
fn pinned_programs(
    dir: &Path,
    pin_dir: &Path,
) -> Option<StdHashMap<&'static str, SchedClassifier>> {
    let maps: HashSet<u32> = PINNED
        .iter()
        .filter_map(|m| {
            Some(
                MapData::from_pin(pin_dir.join(m.name))
                    .ok()?
                    .info()
                    .ok()?
                    .id(),
            )
        })
        .collect();
    let mut out = StdHashMap::new();
    for name in PROGRAMS {
        let p = SchedClassifier::from_pin(dir.join(name)).ok()?;
        let ids = super::pins::prog_map_ids(p.fd().ok()?.as_fd()).ok()?;
        if ids.is_empty() || !ids.iter().all(|i| maps.contains(i)) {
            return None;
        }
        out.insert(name, p);
    }
    Some(out)
}

fn is_bpffs(dir: &Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    nix::sys::statfs::statfs(dir).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
}

struct Maps {
    config: Array<MapData, DpConfig>,
    counters: PerCpuArray<MapData, u64>,
    sandboxes: HashMap<MapData, u32, DpSandbox>,
    by_ip: HashMap<MapData, u32, DpTap>,
    allow: LpmTrie<MapData, DpPolicyData, u8>,
    deny: LpmTrie<MapData, DpPolicyData, u8>,
    portmap: HashMap<MapData, DpPortmapKey, DpPortmapVal>,
    attached: HashMap<MapData, u32, u32>,
    sb_stats: HashMap<MapData, u32, DpSbStats>,
    sb_share: HashMap<MapData, u32, DpShare>,
}

fn take<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    bpf: &mut Ebpf,
    name: &'static str,
) -> Result<T, DatapathError> {
    let map = bpf
        .take_map(name)
        .ok_or_else(|| err("finding a map", name))?;
    T::try_from(map).map_err(|e| err("opening a map", format!("{name}: {e}")))
}

/// (allow, deny) LPM keys installed for one sandbox.
type PolicyKeys = (Vec<Key<DpPolicyData>>, Vec<Key<DpPolicyData>>);

struct Inner {
    maps: Maps,
    /// sandbox ip -> policy keys installed for it (allow, deny).
    policies: StdHashMap<u32, PolicyKeys>,
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
    /// every [`GONE_CHECK_EVERY`]th (a lookup per device).
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
}

/// Every (key, value) of the flow map `map`, a few thousand per
/// BPF_MAP_LOOKUP_BATCH call: the reaper's pass over 100k flows costs a
/// few dozen syscalls instead of two per flow (aya's iterator), so it takes
/// little CPU from the request path on a busy node. None if the kernel
/// refuses batched lookups; the caller then walks entry by entry.
fn dump_flows<K: aya::Pod + Default, V: aya::Pod + Default>(map: &MapData) -> Option<Vec<(K, V)>> {
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    let (keys, vals, n) = super::pins::batch_raw(map.fd().as_fd(), ks, vs).ok()??;
    Some(
        (0..n)
            .map(|i| {
                // SAFETY: `keys` and `vals` hold `n` entries of exactly
                // these sizes; K and V are Pod (every bit pattern valid),
                // read unaligned from the byte buffers.
                unsafe {
                    (
                        std::ptr::read_unaligned(keys[i * ks..].as_ptr().cast::<K>()),
                        std::ptr::read_unaligned(vals[i * vs..].as_ptr().cast::<V>()),
                    )
                }
            })
            .collect(),
    )
}

/// The reaper looks for attachments of devices that no longer exist on
/// every this many passes (the first included): one lookup per TAP.
const GONE_CHECK_EVERY: u64 = 15;

/// The last generation handed out by this process (see [`new_generation`]).
static LAST_GENERATION: AtomicU64 = AtomicU64::new(0);

/// A generation for a new owner of a sandbox address: CLOCK_MONOTONIC in
/// nanoseconds, strictly above every generation this process handed out
/// or found in `by_ip` at load. The clock only moves forward within a
/// boot and pinned maps (bpffs) do not outlive one, so a generation is
/// never handed out twice, across agent restarts included, and nothing
/// but the pinned entries is needed to interpret one.
fn new_generation() -> u64 {
    let now = monotonic_ns();
    let mut last = LAST_GENERATION.load(Ordering::Relaxed);
    loop {
        let next = now.max(last + 1);
        match LAST_GENERATION.compare_exchange_weak(
            last,
            next,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// Counts refreshed by `maintain`, read by `checks` without touching maps.
#[derive(Default)]
struct Stats {
    flows: AtomicUsize,
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
    stats: Stats,
    node: NodeInfo,
    node_hooks: Vec<Hook>,
    /// Tag of each program of this build (what `check` compares with).
    tags: StdHashMap<&'static str, u64>,
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
    /// `dns_learned`, written by the resolver's answers behind a lock of
    /// its own (never `inner`, which the ensure path needs).
    learned: Mutex<HashMap<MapData, DpLearnedKey, DpLearnedVal>>,
    /// `by_ip` for reads without `inner` (the owner's generation).
    by_ip_read: HashMap<MapData, u32, DpTap>,
    /// `dns_learned` and `by_ip` for batched dumps without `inner`.
    learned_dump: MapData,
    by_ip_read_dump: MapData,
    /// Pinned maps migrated or recreated at load (layout changed).
    migrated: Vec<String>,
    /// The config this agent wrote (what `datapath` compares the map with).
    config: DpConfig,
    /// The id of the map behind each pin, at load (what `datapath_pins`
    /// compares the pins with).
    pin_ids: Vec<(&'static str, u32)>,
    /// Whether host -> 127.x:host_port mappings can work.
    localnet: Result<(), String>,
}

impl EbpfDatapath {
    /// Loads the object (re-using pinned maps), writes the config and
    /// attaches the node programs (uplink ingress, gateway-device egress).
    pub fn load(node: NodeInfo) -> Result<Self, DatapathError> {
        // Every map is pinned by name (that is what carries flows across
        // restarts), so a bpffs is required: say so instead of letting aya
        // fail on a default path.
        if let Err(e) = std::fs::create_dir_all(&node.pin_dir) {
            // Report the real cause (EROFS under a read-only /sys mount,
            // EACCES, ENOENT on sysfs without a bpffs...) with its path.
            return Err(err(
                "bpf_pin_dir",
                format!(
                    "cannot create {}: {e}{}",
                    node.pin_dir.display(),
                    if e.raw_os_error() == Some(libc::EROFS) {
                        " (read-only mount: under systemd the directory itself must be in \
                         ReadWritePaths= and exist before start, see the shipped unit)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if !is_bpffs(&node.pin_dir) {
            return Err(err(
                "bpf_pin_dir",
                format!(
                    "{} is not on a bpffs (mount -t bpf bpf /sys/fs/bpf, or set bpf_pin_dir)",
                    node.pin_dir.display()
                ),
            ));
        }
        // Every decision about the pins is taken before anything changes: a
        // layout this build cannot migrate leaves the running datapath alone.
        let plan = super::pins::plan(&node.pin_dir)?;
        let migrated = plan.changes();
        plan.set_aside()?;
        // Until the switch below, a failure puts the old pins back (the
        // previous build can start again as if nothing happened).
        let mut undo = super::pins::Undo::new(&plan);
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(&node.pin_dir);
        let mut bpf = loader
            .load(OBJECT)
            .map_err(|e| err("loading the eBPF object", crate::error_chain(&e)))?;
        let loading = std::time::Instant::now();
        let (progs, tags, reused) =
            Self::programs(&mut bpf, &node.pin_dir, plan.changes().is_empty())?;
        // The old entries, before the new programs see a packet.
        plan.migrate()?;
        let mut maps = Maps {
            config: take(&mut bpf, "config")?,
            counters: take(&mut bpf, "counters")?,
            sandboxes: take(&mut bpf, "sandboxes")?,
            by_ip: take(&mut bpf, "by_ip")?,
            allow: take(&mut bpf, "policy_allow")?,
            deny: take(&mut bpf, "policy_deny")?,
            portmap: take(&mut bpf, "portmap")?,
            attached: take(&mut bpf, "tap_attached")?,
            sb_stats: take(&mut bpf, "sb_stats")?,
            sb_share: take(&mut bpf, "sb_share")?,
        };
        let learned: HashMap<MapData, DpLearnedKey, DpLearnedVal> = take(&mut bpf, "dns_learned")?;
        let (uplink_ip, uplink_ifindex) = node
            .uplink
            .as_ref()
            .map(|(_, i, a)| (ip_be(*a), *i))
            .unwrap_or((0, 0));
        let cfg = DpConfig {
            guest_ip: ip_be(node.guest_ip),
            gateway_ip: ip_be(node.gateway_ip),
            host_ip: ip_be(node.host_ip),
            uplink_ip,
            uplink_ifindex,
            gwdev_ifindex: node.gwdev_ifindex,
            snat_port_min: node.snat_ports.0,
            snat_port_max: node.snat_ports.1,
            guest_mac: node.guest_mac,
            gateway_mac: node.gateway_mac,
            gwdev_mac: node.gwdev_mac,
            pad: 0,
            hflow_guaranteed: node.hflow_shares.guaranteed,
            hflow_cap: node.hflow_shares.cap,
            hflow_borrow: node.hflow_shares.borrow,
            pad2: 0,
        };
        maps.config
            .set(0, cfg, 0)
            .map_err(|e| err("writing the config map", e))?;
        let written = cfg;
        // Host access: exactly the configured uids (a pin of the last
        // start may hold others).
        {
            let mut access: HashMap<MapData, u32, u8> = take(&mut bpf, "host_access")?;
            let stale: Vec<u32> = access
                .keys()
                .flatten()
                .filter(|u| !node.host_access_uids.contains(u))
                .collect();
            for u in stale {
                let _ = access.remove(&u);
            }
            for u in &node.host_access_uids {
                access
                    .insert(u, 1, 0)
                    .map_err(|e| err("writing host_access", e))?;
            }
        }
        // The anchor's binding first (a block exists while a qdisc binds
        // it), then the block's filter: every bound TAP runs this build's
        // `from_guest` from here on. Then the node devices, each replaced
        // in place.
        let mut node_hooks = vec![
            Hook {
                device: node.anchor.0.clone(),
                ifindex: node.anchor.1,
                place: Place::Bound(node.block),
                program: "from_guest",
            },
            Hook {
                device: format!("tc block {}", node.block),
                ifindex: BLOCK_IFINDEX,
                place: Place::Block(node.block),
                program: "from_guest",
            },
            Hook {
                device: node.gwdev_name.clone(),
                ifindex: node.gwdev_ifindex,
                place: Place::Filter(TcHook::Egress),
                program: "to_sandbox_ip",
            },
            Hook {
                device: "lo".into(),
                ifindex: 1,
                place: Place::Filter(TcHook::Egress),
                program: "from_host",
            },
        ];
        if let Some((name, index, _)) = &node.uplink {
            node_hooks.push(Hook {
                device: name.clone(),
                ifindex: *index,
                place: Place::Filter(TcHook::Ingress),
                program: "from_uplink",
            });
            node_hooks.push(Hook {
                device: name.clone(),
                ifindex: *index,
                place: Place::Filter(TcHook::Egress),
                program: "to_uplink",
            });
        }
        // The switch: from here on a failure is fatal (the agent must not
        // run a half-switched datapath; the next start takes it up again).
        undo.disarm();
        let fatal = |mut e: DatapathError| {
            e.fatal = true;
            e
        };
        // Every TAP first (the anchor and the block's filter: all bound
        // TAPs at once; then those with a filter of their own), the node
        // devices after.
        for h in &node_hooks[..2] {
            install(&progs, h).map_err(fatal)?;
        }
        let TakenOver {
            own: own_filter,
            stale,
            kept,
        } = Self::take_over_taps(&progs, &mut maps.attached).map_err(fatal)?;
        for h in &node_hooks[2..] {
            install(&progs, h).map_err(fatal)?;
        }
        // The old programs run nowhere now: what they wrote meanwhile, then
        // the old maps and programs go.
        plan.finish().map_err(fatal)?;
        Self::drop_other_builds(&node.pin_dir);
        // Replies to the host's own connections to 127.x:host_port are
        // redirected into lo as fresh packets that need a route lookup:
        // the kernel treats a 127/8 destination (route_localnet) and a
        // local source address (accept_local) as martian unless allowed.
        // Only lo is changed: packets arriving on lo are local by
        // construction.
        let localnet = crate::sysctl::enable_loopback_localnet();
        // Rebuild the per-sandbox indexes from the (possibly pinned) maps.
        let mut policies: StdHashMap<u32, PolicyKeys> = StdHashMap::new();
        for k in maps.allow.keys().flatten() {
            policies.entry(k.data().sandbox_ip).or_default().0.push(k);
        }
        for k in maps.deny.keys().flatten() {
            policies.entry(k.data().sandbox_ip).or_default().1.push(k);
        }
        // Deny values follow from the key (an older build wrote 1, the
        // catch-all's, for every deny): rewritten before any sandbox's
        // learned address meets them.
        for keys in policies.values() {
            for k in &keys.1 {
                let value = deny_value(k);
                if maps.deny.get(k, 0).ok() != Some(value) {
                    maps.deny
                        .insert(k, value, 0)
                        .map_err(|e| err("rewriting policy_deny", e))?;
                }
            }
        }
        let mut portmaps: StdHashMap<u32, Vec<DpPortmapKey>> = StdHashMap::new();
        for (k, v) in maps.portmap.iter().flatten() {
            portmaps.entry(v.sandbox_ip).or_default().push(k);
        }
        // New generations stay above the pinned ones (guards against a
        // clock that is not this boot's, e.g. another time namespace).
        let reopen = |name: &str| {
            MapData::from_pin(node.pin_dir.join(name))
                .map_err(|e| err("re-opening a pinned map", format!("{name}: {e}")))
        };
        let newest = dump_flows::<u32, DpTap>(&reopen("by_ip")?)
            .unwrap_or_else(|| maps.by_ip.iter().flatten().collect())
            .into_iter()
            .map(|(_, t)| t.generation)
            .max();
        LAST_GENERATION.fetch_max(newest.unwrap_or(0), Ordering::Relaxed);
        let reaper = Reaper {
            ct: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct")?))
                .map_err(|e| err("opening ct", e))?,
            ct_rev: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct_rev")?))
                .map_err(|e| err("opening ct_rev", e))?,
            attached: HashMap::try_from(aya::maps::Map::HashMap(reopen("tap_attached")?))
                .map_err(|e| err("opening tap_attached", e))?,
            by_ip: HashMap::try_from(aya::maps::Map::HashMap(reopen("by_ip")?))
                .map_err(|e| err("opening by_ip", e))?,
            by_ip_dump: reopen("by_ip")?,
            attached_dump: reopen("tap_attached")?,
            passes: 0,
            ct_dump: reopen("ct")?,
            host_nat: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("host_nat")?))
                .map_err(|e| err("opening host_nat", e))?,
            host_nat_dump: reopen("host_nat")?,
            hflow: HashMap::try_from(aya::maps::Map::HashMap(reopen("hflow")?))
                .map_err(|e| err("opening hflow", e))?,
            hflow_dump: reopen("hflow")?,
            hrev: HashMap::try_from(aya::maps::Map::HashMap(reopen("hrev")?))
                .map_err(|e| err("opening hrev", e))?,
            hrev_dump: reopen("hrev")?,
            sb_share: HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_share")?))
                .map_err(|e| err("opening sb_share", e))?,
            sb_share_dump: reopen("sb_share")?,
            share_pool: Array::try_from(aya::maps::Map::Array(reopen("share_pool")?))
                .map_err(|e| err("opening share_pool", e))?,
            hflow_shares: node.hflow_shares,
            sb_stats: HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_stats")?))
                .map_err(|e| err("opening sb_stats", e))?,
            sb_dump: reopen("sb_stats")?,
        };
        let sb_read = Mutex::new(
            HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_stats")?))
                .map_err(|e| err("opening sb_stats", e))?,
        );
        let sb_read_dump = reopen("sb_stats")?;
        let attached_forget = reopen("tap_attached")?;
        let learned_dump = reopen("dns_learned")?;
        let by_ip_read_dump = reopen("by_ip")?;
        let by_ip_read = HashMap::try_from(aya::maps::Map::HashMap(reopen("by_ip")?))
            .map_err(|e| err("opening by_ip", e))?;
        let pin_ids = PINNED
            .iter()
            .map(|m| {
                let id = MapData::from_pin(node.pin_dir.join(m.name))
                    .and_then(|d| d.info())
                    .map(|i| i.id())
                    .unwrap_or(0);
                (m.name, id)
            })
            .collect();
        let names: Vec<String> = node_hooks.iter().map(Hook::to_string).collect();
        info!(
            pin_dir = %node.pin_dir.display(),
            node_programs = ?names,
            from_guest_tag = format!("{:016x}", tags["from_guest"]),
            own_filter = own_filter.len(),
            migrated = ?migrated,
            programs = if reused { "pinned by an earlier start of this build" } else { "loaded and verified" },
            elapsed_ms = loading.elapsed().as_millis() as u64,
            "eBPF datapath loaded"
        );
        let dp = Self {
            inner: Mutex::new(Inner {
                maps,
                policies,
                portmaps,
            }),
            progs,
            reaper: Mutex::new(reaper),
            stats: Stats {
                taps: AtomicUsize::new(kept),
                own: AtomicUsize::new(own_filter.len()),
                ..Default::default()
            },
            node,
            node_hooks,
            tags,
            own_filter: Mutex::new(own_filter),
            stale: Mutex::new(stale),
            block_lost: Default::default(),
            attached_forget,
            sb_read,
            sb_read_dump,
            learned: Mutex::new(learned),
            by_ip_read,
            learned_dump,
            by_ip_read_dump,
            migrated,
            localnet,
            config: written,
            pin_ids,
        };
        // Counts for Health come from the first reaper pass (2 s after start);
        // walking every flow and TAP here would delay READY.
        Ok(dp)
    }

    /// This build's programs: the ones an earlier start of this build
    /// pinned under `programs/<build id>` (same object, same maps: no
    /// verifier pass), else loaded and verified now and pinned there for
    /// the next start. Other builds' pins are removed once the switch is
    /// done ([`Self::drop_other_builds`]).
    fn programs(
        bpf: &mut Ebpf,
        pin_dir: &Path,
        maps_kept: bool,
    ) -> Result<(Programs, StdHashMap<&'static str, u64>, bool), DatapathError> {
        let (mut progs, mut tags) = (Programs::new(), StdHashMap::new());
        let mut keep = |name: &'static str, p: &SchedClassifier| -> Result<(), DatapathError> {
            let info = p.info().map_err(|e| err("reading a program's tag", e))?;
            tags.insert(name, info.tag());
            let fd = p
                .fd()
                .map_err(|e| err("program fd", e))?
                .try_clone()
                .map_err(|e| err("program fd", e))?;
            progs.insert(name, fd);
            Ok(())
        };
        let dir = pin_dir.join("programs").join(build_id());
        if maps_kept && let Some(pinned) = pinned_programs(&dir, pin_dir) {
            for (name, p) in &pinned {
                keep(name, p)?;
            }
            debug!(dir = %dir.display(), "this build's pinned programs reused");
            return Ok((progs, tags, true));
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| err("pinning the programs", e))?;
        for name in PROGRAMS {
            let p: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or_else(|| err("finding the program", name))?
                .try_into()
                .map_err(|e| err("program type", e))?;
            p.load().map_err(|e| {
                err(
                    "loading a program",
                    format!("{name}: {}", crate::error_chain(&e)),
                )
            })?;
            p.pin(dir.join(name))
                .map_err(|e| err("pinning the programs", format!("{name}: {e}")))?;
            keep(name, p)?;
        }
        Ok((progs, tags, false))
    }

    /// Unpins the programs of other builds: nothing runs them any more
    /// (the kernel frees each with its last filter).
    fn drop_other_builds(pin_dir: &Path) {
        let mine = build_id();
        let Ok(dirs) = std::fs::read_dir(pin_dir.join("programs")) else {
            return;
        };
        for d in dirs.flatten() {
            if d.file_name().to_string_lossy() != mine {
                let _ = std::fs::remove_dir_all(d.path());
            }
        }
    }

    /// The reaper's pass over host flows: host connections in the SNAT
    /// range (`host_nat`) and host <-> sandbox flows (`hflow`), expired by
    /// the same timeouts, host <-> sandbox flows also when their sandbox
    /// was released (generation). Each is re-read right before it is
    /// deleted (a flow touched since the dump waits for the next pass), and
    /// its reverse entry goes with it only if that still points at it.
    /// Returns (flows seen, flows removed).
    fn reap_host_flows(
        r: &mut Reaper,
        taps: &StdHashMap<u32, DpTap>,
        now: u64,
        t: FlowTimeouts,
    ) -> (usize, usize) {
        let expired = |proto: u8, state: u8, last: u64| {
            now.saturating_sub(last) > t.limit(proto, state).as_nanos() as u64
        };
        // A guest's DNS over UDP (to its gateway, or redirected to the
        // resolver) is done within the resolver's upstream timeout: its
        // entries go after DNS_UDP_IDLE, not the UDP timeout, so a guest
        // that resolves a lot holds few of its share.
        let dns_udp = |k: &DpHflowKey, v: &DpHflowVal| {
            k.proto == libc::IPPROTO_UDP as u8
                && v.gw_port == 53u16.to_be()
                && now.saturating_sub(v.last_seen_ns) > DNS_UDP_IDLE.as_nanos() as u64
        };
        let (mut seen, mut removed) = (0, 0);
        let nat: Vec<(DpRevKey, DpCtVal)> =
            dump_flows(&r.host_nat_dump).unwrap_or_else(|| r.host_nat.iter().flatten().collect());
        seen += nat.len();
        for (k, v) in nat {
            if !expired(k.proto, v.state, v.last_seen_ns)
                || r.host_nat.get(&k, 0).ok().as_ref() != Some(&v)
            {
                continue;
            }
            let _ = r.host_nat.remove(&k);
            let rk = DpRevKey {
                nat_port: v.nat_port,
                ..k
            };
            if r.ct_rev
                .get(&rk, 0)
                .is_ok_and(|rv| rv.sandbox_ip == 0 && rv.guest_port == k.nat_port)
            {
                let _ = r.ct_rev.remove(&rk);
            }
            removed += 1;
        }
        let hflows: Vec<(DpHflowKey, DpHflowVal)> =
            dump_flows(&r.hflow_dump).unwrap_or_else(|| r.hflow.iter().flatten().collect());
        // Every sandbox's share, right after the dump: what the datapath
        // adds and gives back from here on is carried over (see below).
        let before = Self::shares(r);
        seen += hflows.len();
        let mut held: StdHashMap<u32, i64> = StdHashMap::new();
        for (k, v) in hflows {
            let owner = taps
                .get(&v.sandbox_ip)
                .filter(|o| o.generation == v.generation);
            let stale = owner.is_none();
            if !(stale || expired(k.proto, v.state, v.last_seen_ns) || dns_udp(&k, &v))
                || r.hflow.get(&k, 0).ok().as_ref() != Some(&v)
                || (stale
                    && r.by_ip
                        .get(&v.sandbox_ip, 0)
                        .is_ok_and(|o| o.generation == v.generation))
            {
                if let Some(o) = owner {
                    *held.entry(o.ifindex).or_default() += 1;
                }
                continue;
            }
            let _ = r.hflow.remove(&k);
            let rk = DpHrevKey {
                sandbox_ip: v.sandbox_ip,
                guest_port: v.guest_port,
                gw_port: v.gw_port,
                proto: k.proto,
                pad: [0; 3],
            };
            if r.hrev.get(&rk, 0).is_ok_and(|rv| rv.host == k) {
                let _ = r.hrev.remove(&rk);
            }
            removed += 1;
        }
        Self::recount_shares(r, &before, &held);
        (seen, removed)
    }

    /// Every sandbox's `sb_share` count (ifindex -> host flows).
    fn shares(r: &Reaper) -> StdHashMap<u32, i64> {
        dump_flows::<u32, DpShare>(&r.sb_share_dump)
            .unwrap_or_else(|| r.sb_share.iter().flatten().collect())
            .into_iter()
            .map(|(i, s)| (i, i64::from(s.hflow)))
            .collect()
    }

    /// Sets each sandbox's share to the host flows it holds: `held` (the
    /// entries this pass saw and kept) plus what the datapath changed since
    /// `before` was read (flows opened and closed meanwhile). The
    /// datapath's own counting is exact for what it adds and removes; this
    /// corrects what it cannot see (entries the reaper removed, an earlier
    /// owner's). The shared pool follows from the counts.
    fn recount_shares(r: &mut Reaper, before: &StdHashMap<u32, i64>, held: &StdHashMap<u32, i64>) {
        const BPF_EXIST: u64 = 2;
        let g = i64::from(r.hflow_shares.guaranteed);
        let now = Self::shares(r);
        let mut borrowed = 0i64;
        for (ifindex, current) in &now {
            let meanwhile = current - before.get(ifindex).copied().unwrap_or(*current);
            let n = (held.get(ifindex).copied().unwrap_or(0) + meanwhile).max(0);
            borrowed += (n - g).max(0);
            if n != *current {
                let _ = r.sb_share.insert(
                    ifindex,
                    DpShare {
                        hflow: n as u32,
                        pad: 0,
                    },
                    BPF_EXIST,
                );
            }
        }
        let _ = r.share_pool.set(
            0,
            DpSharePool {
                hflow_borrowed: borrowed.min(i64::from(u32::MAX)) as u32,
                pad: 0,
            },
            0,
        );
    }

    /// `hrev` entries whose host flow is gone (its removal raced with a
    /// takeover): removed so the map holds no more than `hflow`.
    fn reap_orphan_hrev(r: &mut Reaper) -> usize {
        let all: Vec<(DpHrevKey, DpHrevVal)> =
            dump_flows(&r.hrev_dump).unwrap_or_else(|| r.hrev.iter().flatten().collect());
        let mut n = 0;
        for (k, v) in all {
            let live = r.hflow.get(&v.host, 0).is_ok_and(|f| {
                f.sandbox_ip == k.sandbox_ip
                    && f.guest_port == k.guest_port
                    && f.gw_port == k.gw_port
            });
            if !live && r.hrev.get(&k, 0).ok().as_ref() == Some(&v) {
                let _ = r.hrev.remove(&k);
                n += 1;
            }
        }
        n
    }

    /// Pins that are gone or hold another map than at load.
    fn pin_problems(&self) -> Vec<String> {
        self.pin_ids
            .iter()
            .filter_map(|(name, id)| {
                let path = self.node.pin_dir.join(name);
                match MapData::from_pin(&path).and_then(|d| d.info()) {
                    Ok(i) if i.id() == *id => None,
                    Ok(_) => Some(format!("{name}: pinned to another map than this agent's")),
                    Err(_) if !path.exists() => Some(format!("{name}: the pin is gone")),
                    Err(e) => Some(format!("{name}: {e}")),
                }
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn policy_keys(ip: u32, list: &[String]) -> Vec<Key<DpPolicyData>> {
        list.iter()
            .filter_map(|c| c.parse::<crate::alloc::Ipv4Cidr>().ok())
            .map(|c| {
                Key::new(
                    32 + u32::from(c.prefix_len()),
                    DpPolicyData {
                        sandbox_ip: ip,
                        dst: ip_be(c.network()),
                    },
                )
            })
            .collect()
    }

    /// Removes a flow, and its SNAT reverse entry if that still points at
    /// it (a port may have gone to another flow since).
    fn remove_flow(
        ct: &mut HashMap<MapData, DpCtKey, DpCtVal>,
        ct_rev: &mut HashMap<MapData, DpRevKey, DpRevVal>,
        k: &DpCtKey,
        v: &DpCtVal,
    ) {
        let _ = ct.remove(k);
        if v.kind == DP_CT_SNAT {
            let rk = DpRevKey {
                remote_ip: k.remote_ip,
                remote_port: k.remote_port,
                nat_port: v.nat_port,
                proto: k.proto,
                pad: [0; 3],
            };
            if ct_rev.get(&rk, 0).is_ok_and(|r| {
                r.sandbox_ip == k.sandbox_ip
                    && r.guest_port == k.guest_port
                    && r.generation == v.generation
            }) {
                let _ = ct_rev.remove(&rk);
            }
        }
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

    /// Writes the sandbox's entries, journalling each change (see `attach`).
    fn write_entries(
        inner: &mut Inner,
        journal: &mut Vec<Undo>,
        ip: u32,
        ifindex: u32,
        sb: &SandboxPath<'_>,
        (want_allow, want_deny): (&[Key<DpPolicyData>], &[Key<DpPolicyData>]),
        want_ports: &[(DpPortmapKey, DpPortmapVal)],
    ) -> Result<(), DatapathError> {
        let maps = &mut inner.maps;
        // The address's owner keeps its generation (converge, recovery,
        // Reconcile, a TAP recreated under a new ifindex); an address with
        // no entry has a new owner: released sandboxes leave their flows
        // to the reaper, and this generation tells them apart.
        let generation = match maps.by_ip.get(&ip, 0) {
            Ok(t) if t.generation != 0 => t.generation,
            _ => new_generation(),
        };
        // A TAP recreated under a new ifindex leaves an old entry behind.
        if let Ok(old) = maps.by_ip.get(&ip, 0)
            && old.ifindex != ifindex
            && let Ok(prev) = maps.sandboxes.get(&old.ifindex, 0)
        {
            journal.push(Undo::Sandbox(old.ifindex, Some(prev)));
            let _ = maps.sandboxes.remove(&old.ifindex);
        }
        let mut flags = if sb.allow_internet_access {
            DP_F_INTERNET
        } else {
            0
        };
        if sb.has_domain_rules() {
            flags |= DP_F_DOMAINS;
        }
        if sb.strict_egress {
            flags |= DP_F_SNI;
        }
        let entry = DpSandbox {
            sandbox_ip: ip,
            flags,
            generation,
        };
        let prev = maps.sandboxes.get(&ifindex, 0).ok();
        if prev != Some(entry) {
            journal.push(Undo::Sandbox(ifindex, prev));
            maps.sandboxes
                .insert(ifindex, entry, 0)
                .map_err(|e| map_err("writing the sandboxes map", &e))?;
        }
        // The device's own counters start at zero with it (a device
        // carries one network for life); a converge keeps them. Removed
        // by the reaper once the device is gone.
        // One request: an existing entry (a converge) makes it fail.
        const BPF_NOEXIST: u64 = 1;
        let _ = maps
            .sb_stats
            .insert(ifindex, DpSbStats::default(), BPF_NOEXIST);
        let _ = maps
            .sb_share
            .insert(ifindex, DpShare::default(), BPF_NOEXIST);
        let tap = DpTap {
            ifindex,
            pad: 0,
            generation,
        };
        let prev = maps.by_ip.get(&ip, 0).ok();
        if prev != Some(tap) {
            journal.push(Undo::ByIp(ip, prev));
            maps.by_ip
                .insert(ip, tap, 0)
                .map_err(|e| map_err("writing the by_ip map", &e))?;
        }
        // A policy key's value follows from the key (allow: 1; deny: see
        // below): a key this sandbox already
        // has is left alone, a new one is journalled as added. (An LPM
        // `get` is a longest-prefix match, so the index, not the map, says
        // which keys exist.)
        let (have_allow, have_deny) = inner
            .policies
            .get(&ip)
            .map(|(a, d)| {
                (
                    a.iter().map(policy_id).collect::<HashSet<_>>(),
                    d.iter().map(policy_id).collect::<HashSet<_>>(),
                )
            })
            .unwrap_or_default();
        for k in want_allow {
            if !have_allow.contains(&policy_id(k)) {
                maps.allow
                    .insert(k, 1, 0)
                    .map_err(|e| map_err("writing policy_allow (allow_out)", &e))?;
                journal.push(Undo::Allow(*k));
            }
        }
        for k in want_deny {
            if !have_deny.contains(&policy_id(k)) {
                maps.deny
                    .insert(k, deny_value(k), 0)
                    .map_err(|e| map_err("writing policy_deny (deny_out)", &e))?;
                journal.push(Undo::Deny(*k));
            }
        }
        for (k, v) in want_ports {
            let prev = maps.portmap.get(k, 0).ok();
            if prev != Some(*v) {
                journal.push(Undo::Portmap(*k, prev));
                maps.portmap
                    .insert(k, v, 0)
                    .map_err(|e| map_err("writing the portmap map (port_mappings)", &e))?;
            }
        }
        Ok(())
    }

    /// Plays a journal back, newest change first.
    fn roll_back(inner: &mut Inner, journal: Vec<Undo>) {
        let maps = &mut inner.maps;
        for undo in journal.into_iter().rev() {
            let r = match undo {
                Undo::Sandbox(k, Some(v)) => maps.sandboxes.insert(k, v, 0),
                Undo::Sandbox(k, None) => maps.sandboxes.remove(&k),
                Undo::ByIp(k, Some(v)) => maps.by_ip.insert(k, v, 0),
                Undo::ByIp(k, None) => maps.by_ip.remove(&k),
                Undo::Allow(k) => maps.allow.remove(&k),
                Undo::Deny(k) => maps.deny.remove(&k),
                Undo::Portmap(k, Some(v)) => maps.portmap.insert(k, v, 0),
                Undo::Portmap(k, None) => maps.portmap.remove(&k),
            };
            if let Err(e) = r {
                warn!(error = %crate::error_chain(&e), "rolling back a datapath entry failed");
            }
        }
    }

    /// Binds a TAP's (or veth's) clsact qdisc to the shared block unless
    /// it is recorded as running `from_guest` already (bound, or an older
    /// build's filter of its own).
    fn ensure_filter(&self, inner: &mut Inner, ifindex: u32) -> Result<(), DatapathError> {
        if inner.maps.attached.get(&ifindex, 0).is_err() {
            self.join(inner, ifindex, false)?;
        }
        Ok(())
    }

    /// Binds a device (see [`bind`]) and records how it runs `from_guest`.
    fn join(&self, inner: &mut Inner, ifindex: u32, idle: bool) -> Result<(), DatapathError> {
        self.repair_block_if_lost()?;
        let joined = bind(&self.progs, ifindex, self.node.block, idle)?;
        {
            let mut own = self.own_filter.lock().unwrap_or_else(|p| p.into_inner());
            if joined == Joined::OwnFilter {
                own.insert(ifindex);
            } else {
                own.remove(&ifindex);
            }
        }
        self.stale
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(i, _)| *i != ifindex);
        inner
            .maps
            .attached
            .insert(
                ifindex,
                if joined == Joined::Bound {
                    BOUND
                } else {
                    OWN_FILTER
                },
                0,
            )
            .map_err(|e| err("recording the attachment", e))
    }

    /// After the kernel announced a removal on the block or its anchor:
    /// puts the anchor's binding and the block's filter back before a TAP
    /// joins, so that no TAP binds an empty block (a block dies with its
    /// last qdisc, and a new one has no filter).
    fn repair_block_if_lost(&self) -> Result<(), DatapathError> {
        if !self.block_lost.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        for h in self.node_hooks.iter().take(2) {
            if let Err(e) = install(&self.progs, h) {
                self.block_lost.store(true, Ordering::Release);
                return Err(err(
                    "the shared tc block",
                    format!("{h}: {e} (a TAP would run no program: restart the agent)"),
                ));
            }
        }
        info!("the tc block's anchor and filter put back");
        Ok(())
    }

    /// The TAPs and veths an earlier agent attached (`tap_attached`): bound
    /// to the block (2), they run this build's `from_guest` already (and
    /// recovery checks the binding); with a qdisc and filter of their own
    /// (1: a build before the shared block) the filter gets this build's
    /// program in place, one request each; gone from the kernel, they are
    /// forgotten (recovery attaches the ones a network still uses). Returns
    /// the devices with a filter of their own, the ones whose filter could
    /// not be replaced, and how many devices run `from_guest`.
    fn take_over_taps(
        progs: &Programs,
        attached: &mut HashMap<MapData, u32, u32>,
    ) -> Result<TakenOver, DatapathError> {
        let recorded: Vec<(u32, u32)> = attached.iter().flatten().collect();
        let (mut own, mut stale, mut kept) = (HashSet::new(), vec![], 0);
        let fd = prog_fd(progs, "from_guest")?;
        for (ifindex, how) in recorded {
            if how == BOUND {
                kept += 1;
                continue;
            }
            let target = Target::Device {
                ifindex,
                hook: TcHook::Ingress,
            };
            let r = match tc::replace_filter(
                target,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                fd,
                "from_guest",
            ) {
                Ok(()) => {
                    own.insert(ifindex);
                    kept += 1;
                    attached.insert(ifindex, OWN_FILTER, 0)
                }
                // Bound to a shared block after all.
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    kept += 1;
                    attached.insert(ifindex, BOUND, 0)
                }
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::ENOENT | libc::ENODEV)
                    ) =>
                {
                    attached.remove(&ifindex)
                }
                Err(e) => {
                    warn!(ifindex, error = %e, "could not replace an older build's from_guest filter");
                    // Its own filter still runs the older program: the
                    // check compares tags and Reconcile replaces it.
                    own.insert(ifindex);
                    kept += 1;
                    stale.push((ifindex, format!("ifindex {ifindex}: {e}")));
                    Ok(())
                }
            };
            if let Err(e) = r {
                warn!(ifindex, error = %crate::error_chain(&e), "updating tap_attached failed");
            }
        }
        if !own.is_empty() {
            info!(
                devices = own.len(),
                "TAPs attached by an older build keep their own filter, now with this build's from_guest"
            );
        }
        Ok(TakenOver { own, stale, kept })
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

/// Flow-table pressure: `ct` (sandbox flows) and `hflow` (host flows) are
/// LRU maps; past capacity the kernel evicts live flows (connections
/// reset, SNAT ports reused), so 90 % is the warning line. Counted by the
/// reaper every 2 s.
/// Health's `datapath`: the programs and their config (`config`: what the
/// config map holds is what this agent wrote).
fn datapath_check(what: &str, config: Result<(), String>) -> Check {
    match config {
        Ok(()) => ("datapath".into(), true, what.to_owned()),
        Err(e) => (
            "datapath".into(),
            false,
            format!("{e}: restart the agent; {what}"),
        ),
    }
}

/// Health's `datapath_pins`: every map is pinned where this agent pinned
/// it (`problems`: the ones that are not). A map whose pin is gone goes
/// with this agent's last reference: the next start would begin with
/// empty flows, learned addresses and counters.
fn pins_check(dir: &Path, problems: &[String], migrated: &[String]) -> Check {
    let mut s = if problems.is_empty() {
        format!("every map pinned in {}", dir.display())
    } else {
        format!(
            "{}: {}; a restart now would lose what they hold (flows, learned addresses, \
             counters): restart the agent only after checking what removed them",
            dir.display(),
            problems.join("; ")
        )
    };
    if !migrated.is_empty() {
        s.push_str(&format!(
            "; layout changed at this start: {}",
            migrated.join(", ")
        ));
    }
    ("datapath_pins".into(), problems.is_empty(), s)
}

fn loopback_check(localnet: &Result<(), String>) -> Check {
    (
        "datapath_loopback".to_string(),
        localnet.is_ok(),
        match localnet {
            Ok(()) => {
                "host -> 127.0.0.1:host_port mappings enabled (lo: route_localnet=1 accept_local=1)"
                    .into()
            }
            Err(e) => format!("host -> 127.0.0.1:host_port mappings unavailable: {e}"),
        },
    )
}

fn uplink_check(uplink: Option<&(String, u32, Ipv4Addr)>, ports: (u16, u16)) -> Check {
    (
        "datapath_uplink".to_string(),
        uplink.is_some(),
        match uplink {
            Some((n, _, a)) => format!("SNAT to {a} on {n}, ports {}-{}", ports.0, ports.1),
            None => "no uplink: egress and port mappings are dropped".into(),
        },
    )
}

/// A passing and a failing case of every check the datapath reports (for
/// Health's `every_check_can_fail`).
pub fn check_cases() -> Vec<(Check, Check)> {
    let up = ("up0".to_owned(), 2, Ipv4Addr::new(10, 0, 0, 2));
    vec![
        (
            datapath_check("x", Ok(())),
            datapath_check("x", Err("unreadable".into())),
        ),
        (
            flow_table_check(0, 0),
            flow_table_check(FLOW_MAP_ENTRIES as usize, 0),
        ),
        (
            pins_check(Path::new("/p"), &[], &[]),
            pins_check(Path::new("/p"), &["ct: missing".into()], &[]),
        ),
        (
            loopback_check(&Ok(())),
            loopback_check(&Err("EPERM".into())),
        ),
        (
            uplink_check(Some(&up), (1024, 2048)),
            uplink_check(None, (1024, 2048)),
        ),
    ]
}

fn flow_table_check(flows: usize, host_flows: usize) -> Check {
    let pct = |n: usize, cap: u32| n as f64 * 100.0 / f64::from(cap);
    let (f, h) = (
        pct(flows, FLOW_MAP_ENTRIES),
        pct(host_flows, HOST_FLOW_ENTRIES),
    );
    let ok = f < 90.0 && h < 90.0;
    (
        "flow_table".to_string(),
        ok,
        format!(
            "{flows} of {} sandbox flows ({f:.1} %), {host_flows} of {} host flows ({h:.1} %){}",
            FLOW_MAP_ENTRIES,
            HOST_FLOW_ENTRIES,
            if ok {
                ""
            } else {
                "; at 90 % and above new flows evict live ones: fewer flows per sandbox, or shorter timeouts"
            }
        ),
    )
}

/// Whether a network device with this ifindex exists in our namespace.
/// (nix 0.30's `if_indextoname` treats only -1 as failure, but libc returns
/// NULL for an unknown index, so it called every device alive and
/// `tap_attached` leaked an entry per retired TAP.)
fn link_exists(ifindex: u32) -> bool {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as if_indextoname(3) requires;
    // it only writes the name there.
    !unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) }.is_null()
}

fn proto_num(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => libc::IPPROTO_TCP as u8,
        Protocol::Udp => libc::IPPROTO_UDP as u8,
    }
}

/// A policy key as a comparable value (aya's `Key` is packed, no `Eq`).
type PolicyId = (u32, DpPolicyData);

fn policy_id(k: &Key<DpPolicyData>) -> PolicyId {
    (k.prefix_len(), k.data())
}

/// One change `attach` made, with what to put back.
enum Undo {
    Sandbox(u32, Option<DpSandbox>),
    ByIp(u32, Option<DpTap>),
    /// Added by this call: removed on rollback.
    Allow(Key<DpPolicyData>),
    Deny(Key<DpPolicyData>),
    Portmap(DpPortmapKey, Option<DpPortmapVal>),
}

fn map_err(what: &'static str, e: &aya::maps::MapError) -> DatapathError {
    let mut detail = crate::error_chain(e);
    if let aya::maps::MapError::SyscallError(s) = e
        && matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC))
    {
        detail.push_str(" (the map is full)");
    }
    DatapathError {
        what,
        detail,
        fatal: false,
    }
}

/// The port-map entries of a sandbox. `host_ip` "" or 0.0.0.0 is the
/// wildcard (0); the agent has validated it as an IPv4 address.
fn portmap_entries(
    ip: u32,
    mappings: &[crate::agent::spec::PortMapping],
) -> Result<Vec<(DpPortmapKey, DpPortmapVal)>, DatapathError> {
    mappings
        .iter()
        .map(|m| {
            let host: Ipv4Addr = if m.host_ip.is_empty() {
                Ipv4Addr::UNSPECIFIED
            } else {
                m.host_ip.parse().map_err(|_| {
                    err(
                        "port_mappings",
                        format!(
                            "host_ip '{}' of {} {} is not an IPv4 address",
                            m.host_ip, m.protocol, m.host_port
                        ),
                    )
                })?
            };
            Ok((
                DpPortmapKey {
                    host_ip: ip_be(host),
                    host_port: m.host_port.to_be(),
                    proto: proto_num(m.protocol),
                    pad: 0,
                },
                DpPortmapVal {
                    sandbox_ip: ip,
                    container_port: m.container_port.to_be(),
                    pad: 0,
                },
            ))
        })
        .collect()
}

/// A `policy_deny` key's value: the catch-all 0.0.0.0/0 ("anything not
/// allowed") is the one deny a learned address passes; every other deny
/// CIDR beats it (`policy_allows`).
fn deny_value(k: &Key<DpPolicyData>) -> u8 {
    if k.prefix_len() == 32 {
        DP_DENY_CATCH_ALL
    } else {
        DP_DENY_BEATS_LEARNED
    }
}

fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

impl Datapath for EbpfDatapath {
    /// Transactional: every entry written is journalled with what it
    /// replaced, and if any write fails the journal is played back, so a
    /// failed attach leaves exactly the previous state (a new sandbox has
    /// no entry at all, a converge keeps its previous ones in force).
    /// Entries the new state no longer wants are removed only once every
    /// write succeeded.
    fn attach(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        let IpAddr::V4(v4) = sb.sandbox_ip else {
            return Err(err(
                "sandbox address",
                "IPv6 is not supported by the datapath yet",
            ));
        };
        let ip = ip_be(v4);
        let ifindex = sb.tap_ifindex;
        // Everything that can be refused is checked before the first write.
        let want_allow = Self::policy_keys(ip, sb.allow_out);
        let want_deny = Self::policy_keys(ip, sb.deny_out);
        let want_ports = portmap_entries(ip, sb.port_mappings)?;
        let mut guard = self.lock();
        let inner = &mut *guard;
        self.ensure_filter(inner, ifindex)?;
        let mut journal = Vec::new();
        let result = Self::write_entries(
            inner,
            &mut journal,
            ip,
            ifindex,
            sb,
            (&want_allow, &want_deny),
            &want_ports,
        );
        if let Err(e) = result {
            let undone = journal.len();
            Self::roll_back(inner, journal);
            warn!(
                sandbox_id = sb.sandbox_id,
                error = %e,
                undone,
                "datapath attach failed; previous entries restored"
            );
            return Err(e);
        }
        // Committed: drop what the new state no longer wants.
        let (old_allow, old_deny) = inner.policies.remove(&ip).unwrap_or_default();
        let keep_allow: HashSet<PolicyId> = want_allow.iter().map(policy_id).collect();
        let keep_deny: HashSet<PolicyId> = want_deny.iter().map(policy_id).collect();
        for k in old_allow
            .iter()
            .filter(|k| !keep_allow.contains(&policy_id(k)))
        {
            let _ = inner.maps.allow.remove(k);
        }
        for k in old_deny
            .iter()
            .filter(|k| !keep_deny.contains(&policy_id(k)))
        {
            let _ = inner.maps.deny.remove(k);
        }
        inner.policies.insert(ip, (want_allow, want_deny));
        let wanted: HashSet<DpPortmapKey> = want_ports.iter().map(|(k, _)| *k).collect();
        for k in inner.portmaps.remove(&ip).unwrap_or_default() {
            if !wanted.contains(&k)
                && inner
                    .maps
                    .portmap
                    .get(&k, 0)
                    .is_ok_and(|v| v.sandbox_ip == ip)
            {
                let _ = inner.maps.portmap.remove(&k);
            }
        }
        inner.portmaps.insert(ip, wanted.into_iter().collect());
        debug!(
            sandbox_id = sb.sandbox_id,
            tap = sb.tap_name,
            ifindex,
            "datapath entries written"
        );
        Ok(())
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

    /// Bindings from a filter request per device (two sockets in parallel
    /// for many); filters one dump each, compared by program tag with this
    /// build's. TAPs and veths that no longer exist are not reported (the
    /// caller's business); node devices are.
    fn check(&self, hooks: &[Hook]) -> Result<Vec<(usize, String)>, DatapathError> {
        let bindings = ingress_bindings(hooks)?;
        // Hooks with no filter at all are told apart by the node's qdisc
        // dump (taken once, only then).
        let mut all: Option<StdHashMap<u32, Option<u32>>> = None;
        let mut out = vec![];
        for (i, h) in hooks.iter().enumerate() {
            let tag = self.tags.get(h.program).copied().unwrap_or(0);
            let drift = match h.place {
                Place::Bound(block) => {
                    let binding = match bindings[i] {
                        Some(tc::Binding::NoQdisc) | None => None,
                        Some(tc::Binding::Block(b)) => Some(Some(b)),
                        Some(tc::Binding::Own) => Some(None),
                        Some(tc::Binding::NoFilter) => {
                            if all.is_none() {
                                all = Some(
                                    tc::clsact_qdiscs()
                                        .map_err(|e| err("listing clsact qdiscs", e))?,
                                );
                            }
                            all.as_ref().and_then(|a| a.get(&h.ifindex).copied())
                        }
                    };
                    match binding {
                        Some(Some(b)) if b == block => None,
                        Some(Some(b)) => {
                            Some(format!("ingress bound to tc block {b}, not {block}"))
                        }
                        Some(None) => Some(format!(
                            "clsact qdisc of its own, not bound to tc block {block}"
                        )),
                        None => Some("no clsact qdisc".into()),
                    }
                }
                Place::Block(block) => filter_drift(Target::Block(block), h.program, tag)
                    .map_err(|e| tc_err("listing tc filters", &h.device, e))?,
                Place::Filter(hook) => {
                    let target = Target::Device {
                        ifindex: h.ifindex,
                        hook,
                    };
                    match filter_drift(target, h.program, tag) {
                        Ok(d) => d,
                        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => None,
                        Err(e) => return Err(tc_err("listing tc filters", &h.device, e)),
                    }
                }
            };
            // A TAP or veth that is gone is the caller's business; a node
            // device that is gone (the anchor above all) is reported.
            if let Some(d) = drift {
                if h.ifindex == BLOCK_IFINDEX || link_exists(h.ifindex) {
                    out.push((i, d));
                } else if self.node_hooks.contains(h) {
                    out.push((
                        i,
                        format!("device gone ({d}); restart the agent to recreate it"),
                    ));
                }
            }
        }
        Ok(out)
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
        PROGRAMS.iter().map(|p| (*p, self.tags[p])).collect()
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
        addrs: &[(Ipv4Addr, Duration)],
    ) -> Result<(), DatapathError> {
        let ip = ip_be(sandbox_ip);
        let now = monotonic_ns();
        // The owner's generation: an entry outlives neither its owner nor
        // reaches the next one of the address.
        let generation = self
            .by_ip_read
            .get(&ip, 0)
            .map_err(|e| map_err("reading by_ip (the sandbox's generation)", &e))?
            .generation;
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        for (dst, ttl) in addrs {
            let key = DpLearnedKey {
                sandbox_ip: ip,
                dst: ip_be(*dst),
            };
            let mut expires_ns = now + ttl.as_nanos() as u64;
            // A later answer with a shorter TTL never cuts what an earlier
            // one of the same owner gave.
            if let Ok(old) = learned.get(&key, 0)
                && old.generation == generation
            {
                expires_ns = expires_ns.max(old.expires_ns);
            }
            let val = DpLearnedVal {
                expires_ns,
                generation,
            };
            learned
                .insert(key, val, 0)
                .map_err(|e| map_err("writing dns_learned", &e))?;
        }
        Ok(())
    }

    fn learned_entries(&self) -> Vec<(Ipv4Addr, Ipv4Addr, Duration)> {
        // Batched dumps, without the lock `attach` needs (a full map is a
        // million entries).
        let now = monotonic_ns();
        let Some(all) = dump_flows::<DpLearnedKey, DpLearnedVal>(&self.learned_dump) else {
            return vec![];
        };
        let Some(owners) = dump_flows::<u32, DpTap>(&self.by_ip_read_dump) else {
            return vec![];
        };
        let owners: StdHashMap<u32, u64> = owners
            .into_iter()
            .map(|(ip, t)| (ip, t.generation))
            .collect();
        let mut out = Vec::with_capacity(all.len());
        let mut stale = vec![];
        for (k, v) in all {
            if owners.get(&k.sandbox_ip) != Some(&v.generation) {
                // An earlier owner's: unreachable, removed.
                stale.push(k);
                continue;
            }
            out.push((
                Ipv4Addr::from(k.sandbox_ip.to_ne_bytes()),
                Ipv4Addr::from(k.dst.to_ne_bytes()),
                Duration::from_nanos(v.expires_ns.saturating_sub(now)),
            ));
        }
        if !stale.is_empty() {
            let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
            for k in &stale {
                // Only if still an earlier owner's (a lookup may have
                // written it again since the dump).
                let owner = self
                    .by_ip_read
                    .get(&k.sandbox_ip, 0)
                    .ok()
                    .map(|t| t.generation);
                if learned.get(k, 0).is_ok_and(|v| Some(v.generation) != owner) {
                    let _ = learned.remove(k);
                }
            }
        }
        out
    }

    fn forget(&self, sandbox_ip: Ipv4Addr, addrs: &[Ipv4Addr]) {
        let ip = ip_be(sandbox_ip);
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        for dst in addrs {
            let _ = learned.remove(&DpLearnedKey {
                sandbox_ip: ip,
                dst: ip_be(*dst),
            });
        }
    }

    fn detach(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        let IpAddr::V4(v4) = sb.sandbox_ip else {
            return Ok(());
        };
        let ip = ip_be(v4);
        let mut guard = self.lock();
        let inner = &mut *guard;
        let _ = inner.maps.sandboxes.remove(&sb.tap_ifindex);
        if inner
            .maps
            .by_ip
            .get(&ip, 0)
            .is_ok_and(|t| t.ifindex == sb.tap_ifindex)
        {
            let _ = inner.maps.by_ip.remove(&ip);
        }
        let (allow, deny) = inner.policies.remove(&ip).unwrap_or_default();
        for k in &allow {
            let _ = inner.maps.allow.remove(k);
        }
        for k in &deny {
            let _ = inner.maps.deny.remove(k);
        }
        for k in inner.portmaps.remove(&ip).unwrap_or_default() {
            // Only if still ours (a port may already be mapped again).
            if inner
                .maps
                .portmap
                .get(&k, 0)
                .is_ok_and(|v| v.sandbox_ip == ip)
            {
                let _ = inner.maps.portmap.remove(&k);
            }
        }
        // The flows stay for the reaper: no walk of the flow maps here (it
        // cost ~3 µs per flow on the node, under this lock). Without the
        // `sandboxes`/`by_ip` entries nothing reaches or leaves the TAP, and
        // the next owner of the address gets another generation, so none of
        // these flows ever matches its packets.
        debug!(sandbox_id = sb.sandbox_id, "datapath entries removed");
        Ok(())
    }

    fn maintain(&self) {
        let now = monotonic_ns();
        let t = self.node.timeouts;
        let mut guard = self.reaper.lock().unwrap_or_else(|p| p.into_inner());
        let r = &mut *guard;
        // Which generation owns each address now: a flow of another one
        // belongs to a released sandbox (or an earlier owner).
        let taps: StdHashMap<u32, DpTap> = dump_flows::<u32, DpTap>(&r.by_ip_dump)
            .unwrap_or_else(|| r.by_ip.iter().flatten().collect())
            .into_iter()
            .collect();
        let owners: StdHashMap<u32, u64> = taps.iter().map(|(ip, t)| (*ip, t.generation)).collect();
        let mut flows = 0usize;
        let mut stale_n = 0usize;
        let mut by_sandbox: StdHashMap<u32, u64> = StdHashMap::new();
        let all = dump_flows(&r.ct_dump).unwrap_or_else(|| r.ct.iter().flatten().collect());
        let doomed: Vec<(DpCtKey, DpCtVal, bool)> = all
            .into_iter()
            .inspect(|_| flows += 1)
            .filter_map(|(k, v)| {
                let limit = t.limit(k.proto, v.state);
                let stale = owners.get(&k.sandbox_ip) != Some(&v.generation);
                let expired = now.saturating_sub(v.last_seen_ns) > limit.as_nanos() as u64;
                if !stale && !expired {
                    *by_sandbox.entry(k.sandbox_ip).or_default() += 1;
                }
                (stale || expired).then_some((k, v, stale && !expired))
            })
            .collect();
        *self
            .stats
            .by_sandbox
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = by_sandbox;
        let mut removed = 0usize;
        for (k, v, stale) in &doomed {
            // Re-read right before deleting: a flow touched or replaced since
            // the dump (still live, or the new owner's) waits for the next
            // pass, whichever way it was doomed.
            if r.ct.get(k, 0).ok().as_ref() != Some(v) {
                continue;
            }
            if *stale {
                // The owners were read before the walk: an owner attached
                // since then must not have its flows taken for stale.
                if r.by_ip
                    .get(&k.sandbox_ip, 0)
                    .is_ok_and(|o| o.generation == v.generation)
                {
                    continue;
                }
                stale_n += 1;
            }
            Self::remove_flow(&mut r.ct, &mut r.ct_rev, k, v);
            removed += 1;
        }
        let (host_flows, host_removed) = Self::reap_host_flows(r, &taps, now, t);
        // Attachment records of TAPs that no longer exist.
        let (mut taps, mut own) = (0usize, 0usize);
        r.passes += 1;
        let look = r.passes % GONE_CHECK_EVERY == 1;
        let gone: Vec<u32> = dump_flows::<u32, u32>(&r.attached_dump)
            .unwrap_or_else(|| r.attached.iter().flatten().collect())
            .into_iter()
            .inspect(|(_, how)| {
                taps += 1;
                own += usize::from(*how == OWN_FILTER);
            })
            .map(|(i, _)| i)
            .filter(|i| look && !link_exists(*i))
            .collect();
        for i in &gone {
            let _ = r.attached.remove(i);
        }
        // Counters of devices that are gone (released networks' TAPs and
        // veths are deleted off the release path).
        if look {
            let keys: Vec<u32> = dump_flows::<u32, DpSbStats>(&r.sb_dump)
                .unwrap_or_else(|| r.sb_stats.iter().flatten().collect())
                .into_iter()
                .map(|(i, _)| i)
                .collect();
            for i in keys.into_iter().filter(|i| !link_exists(*i)) {
                let _ = r.sb_stats.remove(&i);
            }
            let shares: Vec<u32> = Self::shares(r).into_keys().collect();
            for i in shares.into_iter().filter(|i| !link_exists(*i)) {
                let _ = r.sb_share.remove(&i);
            }
            let orphans = Self::reap_orphan_hrev(r);
            if orphans > 0 {
                debug!(
                    entries = orphans,
                    "hrev entries without a host flow removed"
                );
            }
        }
        {
            let mut o = self.own_filter.lock().unwrap_or_else(|p| p.into_inner());
            o.retain(|i| !gone.contains(i));
            own = own.min(o.len());
        }
        self.stats.own.store(own, Ordering::Relaxed);
        self.stats.flows.store(flows - removed, Ordering::Relaxed);
        self.stats
            .host_flows
            .store(host_flows - host_removed, Ordering::Relaxed);
        self.stats.taps.store(taps - gone.len(), Ordering::Relaxed);
        self.stats
            .reaped
            .fetch_add((removed + host_removed) as u64, Ordering::Relaxed);
        if removed + host_removed > 0 {
            debug!(
                flows = removed,
                of_released_sandboxes = stale_n,
                host_flows = host_removed,
                "expired flows and flows of released sandboxes reaped"
            );
        }
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

    fn sandbox_counters(&self, ifindex: u32) -> Option<Vec<u64>> {
        self.sb_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .ok()
            .map(|s| s.c.to_vec())
    }

    fn all_sandbox_counters(&self) -> StdHashMap<u32, Vec<u64>> {
        dump_flows::<u32, DpSbStats>(&self.sb_read_dump)
            .unwrap_or_else(|| {
                self.sb_read
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .flatten()
                    .collect()
            })
            .into_iter()
            .map(|(i, s)| (i, s.c.to_vec()))
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
        let inner = self.lock();
        let taps = self.stats.taps.load(Ordering::Relaxed);
        let flows = self.stats.flows.load(Ordering::Relaxed);
        let host_flows = self.stats.host_flows.load(Ordering::Relaxed);
        let counters: Vec<String> = Self::counters(&inner)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        // What the programs read: the config this agent wrote.
        let config = match inner.maps.config.get(&0, 0) {
            Ok(c) if c == self.config => Ok(()),
            Ok(_) => Err("the config map holds another config than this agent wrote".to_owned()),
            Err(e) => Err(format!("the config map cannot be read: {e}")),
        };
        drop(inner);
        let what = format!(
            "eBPF: from_guest on {taps} TAPs, {}; {flows} flows, {host_flows} host flows, \
             {} reaped; counters: {}",
            self.node_hooks
                .iter()
                .map(Hook::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            self.stats.reaped.load(Ordering::Relaxed),
            if counters.is_empty() {
                "none".into()
            } else {
                counters.join(" ")
            }
        );
        vec![
            datapath_check(&what, config),
            flow_table_check(flows, host_flows),
            pins_check(&self.node.pin_dir, &self.pin_problems(), &self.migrated),
            loopback_check(&self.localnet),
            uplink_check(self.node.uplink.as_ref(), self.node.snat_ports),
        ]
    }
}
