//! The agent core: every decision about sandbox networks lives here; the
//! wire edges (D-Bus now, varlink/CNI/CLI later) only translate.
//!
//! Concurrency: each sandbox id has its own async mutex (its "slot"), so
//! calls for one id are serialised while calls for different ids run in
//! parallel. Shared state (allocators, the read-side view map, the pool
//! queues) sits behind short synchronous locks that are never held across
//! kernel or disk I/O.

pub mod capacity;
pub mod cni;
mod dns_names;
pub mod domains;
pub mod egress;
pub mod events;
mod flows;
mod health;
mod ipv6;
mod lifecycle;
mod pause;
pub mod pool;
mod ports;
pub mod recover;
mod repair;
mod ring;
pub mod spec;
mod startup;
pub mod traffic;

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::Mutex as AsyncMutex;
use tracing::info;

use crate::alloc::mapping::MappingError;
use crate::alloc::{IpAllocator, PortAllocator, PortSet};
use crate::config::{Config, Derived, format_mac};
use crate::datapath::{Datapath, SandboxPath};
use crate::netlink::Netlink;
use crate::store::Store;
use crate::tap::Tap;
use events::Events;
use pool::TapPool;
use spec::{NetworkRecord, validate_sandbox_id};
use traffic::Traffic;

/// Errors as callers see them; the edges map each variant to their wire
/// error in one place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no network for sandbox '{0}'")]
    NotFound(String),
    /// The node lacks a resource the request needs (another node may have
    /// it): `resource` names it (addresses, host_ports, egress_bandwidth,
    /// ingress_bandwidth).
    #[error("node full ({resource}): {detail}")]
    NodeFull {
        resource: &'static str,
        detail: String,
    },
    #[error("{0}")]
    PortInUse(String),
    /// The TAP is attached to another process (a VMM) and what was asked
    /// needs it free: OpenTap of a TAP the agent has no fd of since a
    /// restart without its fd store, or a new owner for a TAP handed over
    /// by name. Works again once that process lets go.
    #[error("TAP {tap} is held by another process: {why}")]
    TapBusy { tap: String, why: &'static str },
    /// The request conflicts with the network (or namespace) it is about:
    /// ReleaseNetworkIf found the network is not what the caller expected,
    /// or a CNI attachment's namespace is someone else's. Nothing changed.
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Failed(String),
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration")]
    Config(#[from] crate::config::ConfigError),
    #[error("creating {path}")]
    Dir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("opening the state store")]
    Store(#[from] crate::store::StoreError),
    #[error("netlink")]
    Netlink(#[from] crate::netlink::NetlinkError),
    #[error("the eBPF datapath")]
    Datapath(#[from] crate::datapath::DatapathError),
    #[error("tc_block_anchor: {0}")]
    Anchor(String),
}

fn failed(what: &str, e: &dyn std::error::Error) -> AgentError {
    AgentError::Failed(format!("{what}: {}", crate::error_chain(e)))
}

/// A live sandbox network.
struct Network {
    /// Shared with its view (readers, D-Bus object, events): a change
    /// replaces it whole.
    rec: Arc<NetworkRecord>,
    /// The agent's own fd; `None` if the TAP could not be re-attached after
    /// a restart (another process holds its only queue).
    tap: Option<Tap>,
    ifindex: u32,
    /// The TAP was handed to another process (OpenTap), or may have been
    /// (adopted at start-up): release deletes it instead of pooling it.
    handed_out: bool,
}

/// What the datapath needs of a network.
fn sandbox_path(rec: &NetworkRecord, ifindex: u32) -> SandboxPath<'_> {
    SandboxPath {
        sandbox_id: &rec.sandbox_id,
        tap_name: &rec.tap_name,
        tap_ifindex: ifindex,
        sandbox_ip: rec.sandbox_ip,
        port_mappings: &rec.port_mappings,
        allow_internet_access: rec.allow_internet_access,
        allow_out: &rec.allow_out,
        deny_out: &rec.deny_out,
        strict_egress: !rec.egress_mode.is_dns(),
        egress_rules: !rec.egress_rules.is_empty(),
        rule_names: rec.rule_names(),
        bandwidth: rec.bandwidth,
        paused: rec.paused,
        mapping_wins: rec.mapping_wins,
    }
}

/// Runs blocking kernel work (bpf syscalls under the datapath's lock,
/// TUNSETIFF and tc attach, which take RTNL, sysctl writes, the last close
/// of a TAP fd, which waits for an RCU grace period) on tokio's blocking
/// pool: the async workers that serve the bus never wait for it. Netlink
/// requests run on the netlink thread (see [`crate::netlink`]) and the
/// store's writes and fsyncs on its writer thread.
pub(crate) async fn off_worker<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only when the runtime shuts down before the task ran; whoever
        // awaited this is being dropped with it.
        Err(e) => panic!("blocking kernel work cancelled: {e}"),
    }
}

impl Network {
    fn view(&self) -> NetworkView {
        NetworkView {
            record: self.rec.clone(),
            tap_ifindex: self.ifindex,
            tap_fd_held: self.tap.is_some(),
        }
    }
}

/// What readers (Get/List) see; cloned out of the view map. The record
/// is shared by the view map, the D-Bus objects and the events (one copy
/// per network, not one each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkView {
    pub record: Arc<NetworkRecord>,
    pub tap_ifindex: u32,
    pub tap_fd_held: bool,
}

/// Everything a runtime needs to configure the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkInfo {
    pub view: NetworkView,
    pub guest_ip: String,
    pub gateway_ip: String,
    pub guest_mac: String,
    pub gateway_mac: String,
    /// The guest's static IPv6 address (CIDR) and the gateway's link-local
    /// address, on a TAP with the IPv6 link (config `ipv6`); a guest may
    /// configure itself from the gateway's Router Advertisements instead.
    pub guest_ipv6: Option<String>,
    pub gateway_ipv6: Option<String>,
    /// The node-side IPv6 identity (`ipv6_pool` ‖ sandbox address).
    pub sandbox_ipv6: Option<String>,
    /// With the IPv6 link: the sandbox's IPv6 reaches the world (NAT66;
    /// its RAs carry a default route).
    pub ipv6_egress: bool,
    /// With the IPv6 link and no IPv6 egress: why (the node's uplink, the
    /// sandbox's rules), and what opens it.
    pub ipv6_egress_reason: Option<String>,
    /// (destination CIDR, gateway, device) inside the guest.
    pub routes: Vec<(String, String, String)>,
    /// (ip, mac, device) permanent neighbours inside the guest.
    pub arp_neighbors: Vec<(String, String, String)>,
}

/// What EnsureNetwork did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub view: NetworkView,
    pub change: Ensured,
    /// The sequence number of its event (the last one published when
    /// nothing changed): an edge that mirrors events waits for it.
    pub seq: u64,
}

/// Outcome of EnsureNetwork.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    Created,
    Updated,
    Unchanged,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: u32,
    pub repaired: Vec<String>,
    pub removed: Vec<String>,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    pub adopted: u32,
    pub repaired: u32,
    pub fd_lost: Vec<String>,
    pub pool_adopted: u32,
    pub retired: u32,
    pub stale_neighbours: u32,
    pub quarantined: Vec<String>,
    pub store_problems: Vec<String>,
    pub errors: Vec<String>,
    pub elapsed_ms: u64,
}

struct Allocs {
    ips: IpAllocator,
    ports: PortAllocator,
    /// Bandwidth the live networks' limits commit, bits/s (Capacity, and
    /// admission against `node_egress_rate`/`node_ingress_rate`).
    bw: Committed,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Committed {
    pub egress_bps: u64,
    pub ingress_bps: u64,
}

impl Committed {
    fn add(&mut self, b: &crate::types::Bandwidth) {
        self.egress_bps = self.egress_bps.saturating_add(b.egress_bps);
        self.ingress_bps = self.ingress_bps.saturating_add(b.ingress_bps);
    }

    fn sub(&mut self, b: &crate::types::Bandwidth) {
        self.egress_bps = self.egress_bps.saturating_sub(b.egress_bps);
        self.ingress_bps = self.ingress_bps.saturating_sub(b.ingress_bps);
    }
}

/// Node facts looked up at start.
#[derive(Debug, Clone)]
struct Gateway {
    ifindex: u32,
    kind: String,
    /// Host <-> sandbox over IPv6: `ipv6_pool` is routed to this device
    /// (false: the node could not, or IPv6 is off).
    pool6: bool,
}

#[derive(Debug, Clone)]
enum Uplink {
    Found {
        name: String,
        ifindex: u32,
        addr: Option<Ipv4Addr>,
        /// Its MTU at start: no sandbox MTU may exceed it (a guest's
        /// full-size packet could not leave, and the datapath sends no
        /// "fragmentation needed").
        mtu: u32,
    },
    Missing(String),
}

type Slot = Arc<AsyncMutex<Option<Network>>>;

/// The host socket owning (protocol, host ip, port), described.
type SocketCheck = dyn Fn(crate::alloc::Protocol, Ipv4Addr, u16) -> Option<String> + Send + Sync;

pub struct Agent {
    cfg: Config,
    d: Derived,
    nl: Netlink,
    store: Store,
    allocs: Mutex<Allocs>,
    slots: Mutex<HashMap<String, Slot>>,
    views: RwLock<BTreeMap<String, NetworkView>>,
    /// Which live network owns a TAP or veth (ifindex -> sandbox id), for
    /// the kernel's link events; kept with `views`.
    by_ifindex: RwLock<HashMap<u32, String>>,
    /// Sandbox devices someone else deleted, renamed, moved or set down
    /// (ifindex -> (sandbox id, what happened)), from the kernel's link
    /// events, until Reconcile (or the device's own recovery) repairs it.
    link_faults: Mutex<BTreeMap<u32, (String, String)>>,
    /// Health's kernel part (the datapath hooks): recomputed when an event
    /// may have changed it or when older than [`health::KERNEL_MAX_AGE`].
    kernel_checks: health::KernelChecks,
    pool: Arc<TapPool>,
    datapath: Arc<dyn Datapath>,
    gateway: Gateway,
    uplink: Uplink,
    /// The uplink's address NAT66 uses (a usable global IPv6 address and
    /// an IPv6 default route out of the uplink), followed live
    /// (`follow_uplink6`); `None`: no IPv6 egress.
    uplink6: std::sync::RwLock<Option<std::net::Ipv6Addr>>,
    recovery: RecoveryReport,
    /// Every change, in order, for the edges.
    events: Arc<Events>,
    /// Devices on which the kernel announced a qdisc or filter removal
    /// (ifindex -> what), until a kernel check finds our filter there again.
    drift: Mutex<BTreeMap<u32, String>>,
    /// Which CNI attachment owns each network namespace: one per
    /// namespace (every attachment's interface has the same address and
    /// default route inside it). See [`Agent::claim_netns`].
    netns_owners: Mutex<HashMap<spec::NetnsId, String>>,
    /// The sockets that held a released CNI network's mapped ports: the
    /// runtime's own reservations, which the same attachment may map
    /// over again for a while (see [`cni`]).
    reservations: Mutex<HashMap<String, cni::Reservations>>,
    /// Set once start-up is done. Before that nothing is served, so
    /// recovery runs datapath calls inline instead of paying a hop to the
    /// blocking pool per network (~25 µs each, 10,000 at a restart).
    serving: std::sync::atomic::AtomicBool,
    /// Domain rules and learned addresses, for the resolver.
    egress: egress::Egress,
    /// The flow log's records (history, subscribers, journal).
    flows: Arc<crate::flows::FlowHub>,
    /// Flow ends already recorded, by flow and start (the datapath's and
    /// the reaper's may both see one: recorded once).
    flow_ends_seen: Mutex<std::collections::HashSet<flows::EndKey>>,
    /// The names behind learned addresses, across restarts.
    dns_names: dns_names::NameLog,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// 128 random bits from the kernel, hex encoded.
fn new_handle() -> String {
    let mut buf = [0u8; 16];
    if crate::random::getrandom(&mut buf).is_err() {
        // Fall back to time + counter: unique enough for a handle.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        buf = (t ^ (u128::from(n) << 64)).to_le_bytes();
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl From<MappingError> for AgentError {
    fn from(e: MappingError) -> Self {
        match e {
            MappingError::MappedElsewhere { .. } | MappingError::HostSocket { .. } => {
                AgentError::PortInUse(e.to_string())
            }
            MappingError::NotAllowed { .. } => AgentError::InvalidArgument(e.to_string()),
            MappingError::Exhausted { .. } => AgentError::NodeFull {
                resource: "host_ports",
                detail: e.to_string(),
            },
        }
    }
}

/// The kernel's own `ip_local_reserved_ports`, if readable.
fn kernel_reserved_ports() -> PortSet {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_default()
}

/// What [`Agent::wire`] does before the datapath's entries.
#[derive(Default)]
struct Wire {
    /// A change of the device (a warm TAP taken from the pool).
    link: Option<crate::netlink::LinkChange>,
    /// The gateway's neighbour entry for the sandbox address.
    neighbour: bool,
}

/// The step of [`Agent::wire`] that failed.
enum Wiring {
    Link(crate::netlink::NetlinkError),
    Neighbour(crate::netlink::NetlinkError),
    Datapath(crate::datapath::DatapathError),
}

impl Agent {
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The flow log's records (docs/flows.md).
    pub fn flows(&self) -> &Arc<crate::flows::FlowHub> {
        &self.flows
    }

    /// Programs the network into the datapath, off the async workers.
    async fn dp_attach(&self, net: &Network) -> Result<(), crate::datapath::DatapathError> {
        match self.wire(net, Wire::default()).await {
            Ok(()) => Ok(()),
            Err(Wiring::Datapath(e)) => Err(e),
            Err(Wiring::Link(_) | Wiring::Neighbour(_)) => unreachable!("datapath only"),
        }
    }

    /// Connects a network whose device exists, in one call on the blocking
    /// pool (one hop per call; inline during recovery): `link` first (a
    /// warm TAP's MTU, up and in-use alias), then with `neighbour` the
    /// gateway's permanent entry for the sandbox address, then the
    /// datapath's entries. Netlink requests go out from that thread
    /// ([`Netlink::set_link_now`]). Stops at the first failure, which it
    /// names; undoing is the caller's.
    async fn wire(&self, net: &Network, how: Wire) -> Result<(), Wiring> {
        let (nl, dp, rec, ifindex) = (
            self.nl.clone(),
            self.datapath.clone(),
            net.rec.clone(),
            net.ifindex,
        );
        let (gateway, mac) = (self.gateway.ifindex, self.d.guest_mac);
        let work = move || {
            if let Some(change) = how.link {
                nl.set_link_now(ifindex, change).map_err(Wiring::Link)?;
            }
            if how.neighbour {
                nl.neigh_replace_permanent_now(gateway, rec.sandbox_ip, mac)
                    .map_err(Wiring::Neighbour)?;
            }
            dp.attach(&sandbox_path(&rec, ifindex))
                .map_err(Wiring::Datapath)
        };
        if !self.serving.load(std::sync::atomic::Ordering::Acquire) {
            return work();
        }
        off_worker(work).await
    }

    /// Disconnects a network (datapath entries, then the neighbour entry),
    /// best effort, in one call on the blocking pool; with `count`, then
    /// reads its final traffic ([`Agent::traffic`]). The errors, for the
    /// caller to report.
    async fn unwire_counting(
        &self,
        net: &Network,
        count: bool,
    ) -> (Vec<String>, Option<Result<Traffic, AgentError>>) {
        let (nl, dp, rec, ifindex) = (
            self.nl.clone(),
            self.datapath.clone(),
            net.rec.clone(),
            net.ifindex,
        );
        let gateway = self.gateway.ifindex;
        let counts = self.egress.counts(rec.sandbox_ip);
        off_worker(move || {
            let mut errors = vec![];
            if let Err(e) = dp.detach(&sandbox_path(&rec, ifindex)) {
                errors.push(crate::error_chain(&e));
            }
            if let Err(e) = nl.neigh_del_now(gateway, rec.sandbox_ip) {
                errors.push(crate::error_chain(&e));
            }
            let t = count.then(|| traffic::read(&nl, &*dp, &rec, ifindex, counts));
            (errors, t)
        })
        .await
    }

    fn allocs(&self) -> std::sync::MutexGuard<'_, Allocs> {
        self.allocs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, id: &str) -> Slot {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.entry(id.to_owned()).or_default().clone()
    }

    /// Drops an empty slot nobody else is waiting on. Clones of a slot are
    /// only made under the map lock, so the count check is race-free.
    fn forget_slot(&self, id: &str, slot: Slot) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::strong_count(&slot) == 2 && slot.try_lock().map(|g| g.is_none()).unwrap_or(false) {
            slots.remove(id);
        }
    }

    fn set_view(&self, net: &Network) {
        self.put_view(net.view());
    }

    /// Publishes a network's view to readers (and the ifindex index).
    fn put_view(&self, view: NetworkView) {
        self.egress_put(&view.record);
        let (id, ifindex) = (view.record.sandbox_id.clone(), view.tap_ifindex);
        let mut views = self.views.write().unwrap_or_else(|p| p.into_inner());
        let old = views.insert(id.clone(), view.clone());
        let mut index = self.by_ifindex.write().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = old.as_ref().filter(|o| o.tap_ifindex != ifindex) {
            index.remove(&old.tap_ifindex);
        }
        if ifindex != 0 {
            index.insert(ifindex, id);
        }
        drop(index);
        drop(views);
        self.readvertise_if_changed(old.as_ref(), &view);
    }

    fn remove_view(&self, id: &str) {
        let old = self
            .views
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        if let Some(old) = old {
            let mut index = self.by_ifindex.write().unwrap_or_else(|p| p.into_inner());
            if index.get(&old.tap_ifindex).is_some_and(|o| o == id) {
                index.remove(&old.tap_ifindex);
            }
            drop(index);
            self.egress_remove(&old.record);
        }
        self.link_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, (owner, _)| owner != id);
    }

    pub fn get(&self, id: &str) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(id)?;
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        views
            .get(id)
            .cloned()
            .ok_or_else(|| AgentError::NotFound(id.to_owned()))
    }

    pub fn list(&self) -> Vec<NetworkView> {
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        views.values().cloned().collect()
    }

    /// Follows every change from now on, with the sequence number of the
    /// last change before the subscription (see [`events`]).
    pub fn subscribe(&self) -> (tokio::sync::broadcast::Receiver<Arc<events::Event>>, u64) {
        self.events.subscribe()
    }

    /// The sequence number of the last change published.
    pub fn events_seen(&self) -> u64 {
        self.events.last()
    }

    /// Guest-side facts for a network (same for every sandbox).
    pub fn describe(&self, view: NetworkView) -> NetworkInfo {
        let dev = "eth0".to_string();
        let gw = self.d.guest_gateway.to_string();
        let gw_mac = format_mac(&self.d.gateway_mac);
        // The datapath's IPv6 link (docs/datapath.md), on TAPs and veths
        // alike (cube-cni then leaves the container's IPv6 on).
        let ipv6 = self.ipv6_link();
        NetworkInfo {
            ipv6_egress: ipv6 && self.ipv6_egress() && view.record.ipv6_open(),
            ipv6_egress_reason: if ipv6 {
                self.ipv6_egress_why(&view.record)
            } else {
                None
            },
            guest_ipv6: ipv6.then(|| format!("{}/64", crate::types::GUEST_IPV6)),
            gateway_ipv6: ipv6.then(|| crate::types::link_local(&self.d.gateway_mac).to_string()),
            sandbox_ipv6: match view.record.sandbox_ip {
                std::net::IpAddr::V4(a) if self.gateway.pool6 => {
                    Some(self.d.pool6_addr(a).to_string())
                }
                _ => None,
            },
            view,
            guest_ip: format!("{}/{}", self.d.guest_ip, self.cfg.guest_prefix_len),
            gateway_ip: gw.clone(),
            guest_mac: format_mac(&self.d.guest_mac),
            gateway_mac: gw_mac.clone(),
            routes: vec![("0.0.0.0/0".into(), gw.clone(), dev.clone())],
            arp_neighbors: vec![(gw, gw_mac, dev)],
        }
    }

    /// Liveness for the watchdog: the core's locks can be taken and the
    /// store's writer still accepts work.
    pub async fn alive(&self) -> bool {
        let _a = self.allocs();
        drop(_a);
        let _v = self.views.read().unwrap_or_else(|p| p.into_inner());
        drop(_v);
        self.store.is_alive()
    }

    /// Clean stop: nothing to flush (every acknowledged change was fsync'ed
    /// before its reply); TAPs, neighbours and the datapath stay in place
    /// for the next start to adopt.
    pub fn shutdown(&self) {
        info!(
            networks = self.active_networks(),
            "shutting down; networks stay in place"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_unique_hex() {
        let a = new_handle();
        assert_eq!(a.len(), 32);
        assert_ne!(a, new_handle());
    }
}
