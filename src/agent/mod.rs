//! The agent core: every decision about sandbox networks lives here; the
//! wire edges (D-Bus now, varlink/CNI/CLI later) only translate.
//!
//! Concurrency: each sandbox id has its own async mutex (its "slot"), so
//! calls for one id are serialised while calls for different ids run in
//! parallel. Shared state (allocators, the read-side view map, the pool
//! queues) sits behind short synchronous locks that are never held across
//! kernel or disk I/O.

pub mod pool;
pub mod recover;
pub mod spec;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Mutex as AsyncMutex;
use tracing::{debug, info, warn};

use crate::alloc::mapping::{HostPortRules, MappingError, Resolved, resolve_ports};
use crate::alloc::{IpAllocator, PortAllocator, PortSet};
use crate::config::{Config, Derived, format_mac};
use crate::datapath::{Check, Datapath, FILTER_PRIORITY, Hook, SandboxPath};
use crate::hostsock::HostSockets;
use crate::netlink::{LinkChange, LinkInfo, Netlink};
use crate::store::Store;
use crate::tap::Tap;
use pool::{PoolTap, TapPool, create_tap};
use spec::{NetworkRecord, NetworkSpec, PortMapping, RECORD_VERSION, validate_sandbox_id};

/// Errors as callers see them; the edges map each variant to their wire
/// error in one place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no network for sandbox '{0}'")]
    NotFound(String),
    #[error("{0}")]
    AddressesExhausted(String),
    #[error("{0}")]
    PortsExhausted(String),
    #[error("{0}")]
    PortInUse(String),
    /// The TAP is attached to another process (a VMM) and the agent has no
    /// fd of its own (it restarted without its fd store): OpenTap works
    /// again once that process lets go.
    #[error(
        "TAP {tap} is held by another process and the agent has no fd of its own since it \
         restarted without its fd store; OpenTap re-attaches it once that process closes it"
    )]
    TapBusy { tap: String },
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
}

fn failed(what: &str, e: &dyn std::error::Error) -> AgentError {
    AgentError::Failed(format!("{what}: {}", crate::error_chain(e)))
}

/// A live sandbox network.
struct Network {
    rec: NetworkRecord,
    /// The agent's own fd; `None` if the TAP could not be re-attached after
    /// a restart (another process holds its only queue).
    tap: Option<Tap>,
    ifindex: u32,
}

impl Network {
    fn path(&self) -> SandboxPath<'_> {
        SandboxPath {
            sandbox_id: &self.rec.sandbox_id,
            tap_name: &self.rec.tap_name,
            tap_ifindex: self.ifindex,
            sandbox_ip: self.rec.sandbox_ip,
            port_mappings: &self.rec.port_mappings,
            allow_internet_access: self.rec.allow_internet_access,
            allow_out: &self.rec.allow_out,
            deny_out: &self.rec.deny_out,
        }
    }

    fn view(&self) -> NetworkView {
        NetworkView {
            record: self.rec.clone(),
            tap_ifindex: self.ifindex,
            tap_fd_held: self.tap.is_some(),
        }
    }
}

/// What readers (Get/List) see; cloned out of the view map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkView {
    pub record: NetworkRecord,
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
    /// (destination CIDR, gateway, device) inside the guest.
    pub routes: Vec<(String, String, String)>,
    /// (ip, mac, device) permanent neighbours inside the guest.
    pub arp_neighbors: Vec<(String, String, String)>,
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
}

/// Node facts looked up at start.
#[derive(Debug, Clone)]
struct Gateway {
    ifindex: u32,
    kind: String,
}

#[derive(Debug, Clone)]
enum Uplink {
    Found {
        name: String,
        ifindex: u32,
        addr: Option<Ipv4Addr>,
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
    pool: Arc<TapPool>,
    datapath: Arc<dyn Datapath>,
    gateway: Gateway,
    uplink: Uplink,
    recovery: RecoveryReport,
    /// Devices on which the kernel announced a qdisc or filter removal
    /// (ifindex -> what), until a kernel check finds our filter there again.
    drift: Mutex<BTreeMap<u32, String>>,
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
    if getrandom(&mut buf).is_err() {
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

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: the kernel writes at most buf.len() bytes into buf, which is a
    // valid, exclusively borrowed buffer.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == buf.len() as isize {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl From<MappingError> for AgentError {
    fn from(e: MappingError) -> Self {
        match e {
            MappingError::MappedElsewhere { .. } | MappingError::HostSocket { .. } => {
                AgentError::PortInUse(e.to_string())
            }
            MappingError::NotAllowed { .. } => AgentError::InvalidArgument(e.to_string()),
            MappingError::Exhausted { .. } => AgentError::PortsExhausted(e.to_string()),
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

impl Agent {
    /// Validates the configuration, opens the store, sets up the gateway
    /// device, recovers every recorded network and starts the pool task.
    /// `inherited` are TAP fds handed back by the service manager's fd
    /// store; they are matched to devices by TUNGETIFF, so recovery never
    /// reopens a TAP it already has an fd for.
    pub async fn start(cfg: Config, inherited: Vec<OwnedFd>) -> Result<Arc<Agent>, StartError> {
        let started = Instant::now();
        let d = cfg.validate()?;
        for path in [&cfg.state_dir, &cfg.runtime_dir] {
            std::fs::create_dir_all(path).map_err(|source| StartError::Dir {
                path: path.clone(),
                source,
            })?;
        }
        let (store, loaded) = Store::open(&cfg.state_dir)?;
        let nl = Netlink::new()?;
        let (gw_link, kind) = nl
            .ensure_gateway_device_with_mtu(
                &cfg.gateway_device,
                d.pool.gateway(),
                d.pool.prefix_len(),
                None,
            )
            .await?;
        info!(device = cfg.gateway_device, kind, ifindex = gw_link.index, pool = %d.pool, "gateway device ready");
        let uplink = Self::find_uplink(&nl, &cfg.uplink).await;
        match &uplink {
            Uplink::Found { name, addr, .. } => info!(uplink = name, address = ?addr, "uplink"),
            Uplink::Missing(why) => warn!(
                reason = why.as_str(),
                "no uplink; egress and port mappings are unavailable"
            ),
        }
        let datapath = Self::build_datapath(&cfg, &d, &cfg.gateway_device, gw_link.index, &uplink);
        let mut excluded = d.reserved_ports.clone();
        excluded.extend(&kernel_reserved_ports());
        let allocs = Allocs {
            ips: IpAllocator::new(d.pool).expect("validated pool"),
            ports: PortAllocator::new(d.port_low, d.port_high, excluded),
        };
        let pool = Arc::new(TapPool::new(
            nl.clone(),
            Netlink::new()?,
            cfg.tap_prefix.clone(),
            cfg.mtu,
            cfg.warm_pool as usize,
            cfg.retire_group,
            datapath.clone(),
        ));
        let mut agent = Agent {
            cfg,
            d,
            nl,
            store,
            allocs: Mutex::new(allocs),
            slots: Mutex::new(HashMap::new()),
            views: RwLock::new(BTreeMap::new()),
            pool,
            datapath,
            gateway: Gateway {
                ifindex: gw_link.index,
                kind,
            },
            uplink,
            recovery: RecoveryReport::default(),
            drift: Mutex::new(BTreeMap::new()),
        };
        // Subscribe before recovery checks the kernel, so a filter removed
        // after that check is still noticed.
        let (tc_tx, mut tc_rx) = tokio::sync::mpsc::unbounded_channel();
        crate::netlink::watch_tc_removals(tc_tx)?;
        let mut inherited_taps: HashMap<String, Tap> = HashMap::new();
        for fd in inherited {
            match Tap::from_fd(fd) {
                Ok(tap) => {
                    inherited_taps.insert(tap.name().to_owned(), tap);
                }
                Err(e) => warn!(error = crate::error_chain(&e), "ignoring an inherited fd"),
            }
        }
        let mut report = agent.recover(loaded.records, inherited_taps).await?;
        report.store_problems = loaded.problems;
        report.elapsed_ms = started.elapsed().as_millis() as u64;
        info!(
            adopted = report.adopted,
            repaired = report.repaired,
            pool_adopted = report.pool_adopted,
            retired = report.retired,
            quarantined = report.quarantined.len(),
            fd_lost = report.fd_lost.len(),
            elapsed_ms = report.elapsed_ms,
            "recovery finished"
        );
        agent.recovery = report;
        let agent = Arc::new(agent);
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            while let Some(removal) = tc_rx.recv().await {
                let Some(agent) = weak.upgrade() else { break };
                agent.note_tc_removal(removal);
            }
        });
        // Fill the pool before serving so the first calls are warm, then
        // keep it topped up in the background.
        agent.pool.refill().await;
        tokio::spawn(agent.pool.clone().run());
        let dp = agent.datapath.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                let dp = dp.clone();
                let _ = tokio::task::spawn_blocking(move || dp.maintain()).await;
            }
        });
        Ok(agent)
    }

    /// The configured datapath; if the eBPF one cannot load, networks still
    /// get TAPs and addresses and Health says why packets do not flow.
    fn build_datapath(
        cfg: &Config,
        d: &Derived,
        gwdev: &str,
        gwdev_ifindex: u32,
        uplink: &Uplink,
    ) -> Arc<dyn Datapath> {
        if cfg.datapath == "none" {
            return Arc::new(crate::datapath::NoopDatapath::configured());
        }
        let gwdev_mac = std::fs::read_to_string(format!("/sys/class/net/{gwdev}/address"))
            .ok()
            .and_then(|s| crate::config::parse_mac(s.trim()))
            .unwrap_or([0; 6]);
        let secs = |s: u32| std::time::Duration::from_secs(s.into());
        let node = crate::datapath::ebpf::NodeInfo {
            guest_ip: d.guest_ip,
            gateway_ip: d.guest_gateway,
            host_ip: d.pool.gateway(),
            guest_mac: d.guest_mac,
            gateway_mac: d.gateway_mac,
            gwdev_name: gwdev.to_owned(),
            gwdev_ifindex,
            gwdev_mac,
            uplink: match uplink {
                Uplink::Found {
                    name,
                    ifindex,
                    addr: Some(a),
                } => Some((name.clone(), *ifindex, *a)),
                _ => None,
            },
            snat_ports: d.snat_ports,
            pin_dir: cfg.bpf_pin_dir.clone(),
            timeouts: crate::datapath::ebpf::FlowTimeouts {
                tcp: secs(cfg.flow_timeout_tcp),
                tcp_closing: secs(cfg.flow_timeout_tcp_closing),
                udp: secs(cfg.flow_timeout_udp),
                icmp: secs(cfg.flow_timeout_icmp),
            },
        };
        match crate::datapath::ebpf::EbpfDatapath::load(node) {
            Ok(dp) => Arc::new(dp),
            Err(e) => {
                warn!(error = %e, "the eBPF datapath could not be loaded");
                Arc::new(crate::datapath::NoopDatapath::failed(&e.to_string()))
            }
        }
    }

    async fn find_uplink(nl: &Netlink, configured: &str) -> Uplink {
        if configured.is_empty() {
            return match nl.default_uplink().await {
                Ok(Some((link, addr))) => Uplink::Found {
                    name: link.name,
                    ifindex: link.index,
                    addr,
                },
                Ok(None) => Uplink::Missing("no IPv4 default route".into()),
                Err(e) => Uplink::Missing(crate::error_chain(&e)),
            };
        }
        match nl.link_by_name(configured).await {
            Ok(Some(link)) => {
                let addr = nl
                    .ipv4_addrs(link.index)
                    .await
                    .ok()
                    .and_then(|a| a.first().map(|(ip, _)| *ip));
                Uplink::Found {
                    name: link.name,
                    ifindex: link.index,
                    addr,
                }
            }
            Ok(None) => Uplink::Missing(format!("configured uplink '{configured}' does not exist")),
            Err(e) => Uplink::Missing(crate::error_chain(&e)),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
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
        let mut views = self.views.write().unwrap_or_else(|p| p.into_inner());
        views.insert(net.rec.sandbox_id.clone(), net.view());
    }

    fn remove_view(&self, id: &str) {
        let mut views = self.views.write().unwrap_or_else(|p| p.into_inner());
        views.remove(id);
    }

    /// Resolves "" host IPs to the default bind address so stored records
    /// and comparisons are explicit.
    fn normalise(&self, mut spec: NetworkSpec) -> NetworkSpec {
        for m in &mut spec.port_mappings {
            if m.host_ip.is_empty() {
                m.host_ip = self.d.default_host_ip.to_string();
            }
        }
        spec
    }

    /// What a new mapping's host port must pass (see `alloc::mapping`).
    fn port_rules<'a>(&'a self, sockets: &'a SocketCheck) -> HostPortRules<'a> {
        HostPortRules {
            range: (self.d.port_low, self.d.port_high),
            allowed: &self.d.allowed_ports,
            host_socket: sockets,
        }
    }

    /// Checks each mapping's host address (a node address, loopback or the
    /// wildcard) and, when the request may claim a host port, takes a
    /// snapshot of the host's sockets, outside every lock.
    async fn host_sockets(
        &self,
        spec: &NetworkSpec,
        existing: &[PortMapping],
    ) -> Result<Box<SocketCheck>, AgentError> {
        let specific: Vec<(usize, Ipv4Addr)> = spec
            .port_mappings
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.host_ip.parse::<Ipv4Addr>().ok().map(|a| (i, a)))
            .filter(|(_, a)| !a.is_unspecified() && !a.is_loopback())
            .collect();
        if !specific.is_empty() {
            let local = self
                .nl
                .local_ipv4_addrs()
                .await
                .map_err(|e| failed("listing the node's addresses", &e))?;
            if let Some((i, a)) = specific.iter().find(|(_, a)| !local.contains(a)) {
                return Err(AgentError::InvalidArgument(format!(
                    "port_mappings[{i}]: host_ip {a} is not an address of this node \
                     (use 0.0.0.0 for every address, or one of {})",
                    local
                        .iter()
                        .map(Ipv4Addr::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        // Every wanted mapping already held by this network: nothing new
        // is claimed, no need to read the kernel's tables.
        let all_kept = spec.port_mappings.iter().all(|m| {
            existing.iter().any(|e| {
                e.protocol == m.protocol
                    && (e.host_port == m.host_port
                        || (m.host_port == 0
                            && e.container_port == m.container_port
                            && e.host_ip == m.host_ip))
            })
        });
        if all_kept {
            return Ok(Box::new(|_, _, _| None));
        }
        let table = tokio::task::spawn_blocking(HostSockets::scan)
            .await
            .map_err(|e| failed("reading the host's sockets", &e))?;
        Ok(Box::new(move |proto, ip, port| {
            table.owner(proto, ip, port).map(ToString::to_string)
        }))
    }

    /// EnsureNetwork: creates the network, or converges an existing one to
    /// `spec` without changing its address or TAP.
    pub async fn ensure(
        &self,
        id: &str,
        spec: NetworkSpec,
    ) -> Result<(NetworkView, Ensured), AgentError> {
        let started = Instant::now();
        validate_sandbox_id(id)?;
        let spec = self.normalise(spec.validated()?);
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            match guard.as_mut() {
                Some(net) => self.converge(net, spec).await.map(|e| (net.view(), e)),
                None => match self.create(id, spec).await {
                    Ok(net) => {
                        let view = net.view();
                        *guard = Some(net);
                        Ok((view, Ensured::Created))
                    }
                    Err(e) => Err(e),
                },
            }
        };
        if let Ok((view, change)) = &result {
            if *change != Ensured::Unchanged {
                let mut views = self.views.write().unwrap_or_else(|p| p.into_inner());
                views.insert(id.to_owned(), view.clone());
            }
            info!(
                sandbox_id = id,
                tap = view.record.tap_name,
                sandbox_ip = %view.record.sandbox_ip,
                outcome = ?change,
                elapsed_us = started.elapsed().as_micros() as u64,
                "network ensured"
            );
        }
        self.forget_slot(id, slot);
        result
    }

    async fn create(&self, id: &str, spec: NetworkSpec) -> Result<Network, AgentError> {
        let sockets = self.host_sockets(&spec, &[]).await?;
        let (ip, mappings) = {
            let mut a = self.allocs();
            let ip = a.ips.allocate().ok_or_else(|| {
                AgentError::AddressesExhausted(format!(
                    "no free sandbox address left in pool {} ({} in use)",
                    self.d.pool,
                    a.ips.capacity()
                ))
            })?;
            match resolve_ports(
                &mut a.ports,
                &spec.port_mappings,
                &[],
                &self.port_rules(&sockets),
            ) {
                Ok(r) => (ip, r.mappings),
                Err(e) => {
                    a.ips.release(ip);
                    return Err(e.into());
                }
            }
        };
        let rec = NetworkRecord {
            version: RECORD_VERSION,
            sandbox_id: id.to_owned(),
            network_handle: new_handle(),
            sandbox_ip: IpAddr::V4(ip),
            tap_name: spec::tap_name_for(&self.cfg.tap_prefix, IpAddr::V4(ip)),
            mtu: spec.mtu.unwrap_or(self.cfg.mtu),
            port_mappings: mappings,
            allow_internet_access: spec.allow_internet_access.unwrap_or(true),
            allow_out: spec.allow_out,
            deny_out: spec.deny_out,
            metadata: spec.metadata,
            idempotency_key: spec.idempotency_key,
            created_unix: now_unix(),
        };
        let net = match self.bring_up(rec).await {
            Ok(net) => net,
            Err((rec, e)) => {
                self.release_allocs(&rec);
                return Err(e);
            }
        };
        if let Err(e) = self.store.put(id, net.rec.to_bytes()).await {
            let err = failed("recording the network durably", &e);
            self.tear_down(net).await;
            return Err(err);
        }
        Ok(net)
    }

    fn release_allocs(&self, rec: &NetworkRecord) {
        let mut a = self.allocs();
        if let IpAddr::V4(ip) = rec.sandbox_ip {
            a.ips.release(ip);
        }
        for m in &rec.port_mappings {
            a.ports.release(m.protocol, m.host_port);
        }
    }

    /// TAP (warm or cold) → name, MTU, up → neighbour → datapath. Undoes its
    /// own partial work on failure.
    async fn bring_up(&self, rec: NetworkRecord) -> Result<Network, (NetworkRecord, AgentError)> {
        let pt = match self.pool.take() {
            Some(pt) => {
                let change = LinkChange {
                    name: Some(rec.tap_name.clone()),
                    mtu: Some(rec.mtu),
                    up: Some(true),
                    group: None,
                };
                if let Err(e) = self.nl.set_link(pt.ifindex, change).await {
                    let err = failed(&format!("configuring pool TAP {}", pt.tap.name()), &e);
                    self.pool.give_back(pt).await;
                    return Err((rec, err));
                }
                let mut pt = pt;
                pt.tap.set_name(rec.tap_name.clone());
                debug!(
                    sandbox_id = rec.sandbox_id,
                    tap = rec.tap_name,
                    "warm TAP taken from pool"
                );
                pt
            }
            None => match self.cold_tap(&rec.tap_name, rec.mtu).await {
                Ok(pt) => pt,
                Err(e) => return Err((rec, e)),
            },
        };
        let mut net = Network {
            rec,
            ifindex: pt.ifindex,
            tap: Some(pt.tap),
        };
        if let Err(e) = self
            .nl
            .neigh_replace_permanent(self.gateway.ifindex, net.rec.sandbox_ip, self.d.guest_mac)
            .await
        {
            let err = failed("adding the neighbour entry", &e);
            let rec = net.rec.clone();
            self.recycle(&mut net).await;
            return Err((rec, err));
        }
        if let Err(e) = self.datapath.attach(&net.path()) {
            let err = failed("programming the datapath", &e);
            let rec = net.rec.clone();
            self.unwire(&net).await;
            self.recycle(&mut net).await;
            return Err((rec, err));
        }
        Ok(net)
    }

    /// Creates a TAP with its final name (pool empty, or recovery repair).
    async fn cold_tap(&self, name: &str, mtu: u32) -> Result<PoolTap, AgentError> {
        let pt = create_tap(name).map_err(|e| failed(&format!("creating TAP {name}"), &e))?;
        let change = LinkChange {
            mtu: Some(mtu),
            up: Some(true),
            ..Default::default()
        };
        if let Err(e) = self.nl.set_link(pt.ifindex, change).await {
            let err = failed(&format!("configuring TAP {name}"), &e);
            self.pool.retire(pt);
            return Err(err);
        }
        debug!(tap = name, "cold TAP created");
        Ok(pt)
    }

    /// Removes the neighbour entry and datapath state; best effort, errors
    /// are returned for the caller to report.
    async fn unwire(&self, net: &Network) -> Vec<String> {
        let mut errors = vec![];
        if let Err(e) = self.datapath.detach(&net.path()) {
            errors.push(crate::error_chain(&e));
        }
        if let Err(e) = self
            .nl
            .neigh_del(self.gateway.ifindex, net.rec.sandbox_ip)
            .await
        {
            errors.push(crate::error_chain(&e));
        }
        errors
    }

    /// Returns the TAP to the pool (or deletes it if we hold no fd).
    async fn recycle(&self, net: &mut Network) {
        match net.tap.take() {
            Some(tap) => {
                self.pool
                    .give_back(PoolTap {
                        tap,
                        ifindex: net.ifindex,
                    })
                    .await
            }
            None if net.ifindex != 0 => self.pool.retire_link(net.ifindex),
            None => {}
        }
    }

    /// Undoes a whole network: datapath, neighbour, TAP, address, ports.
    async fn tear_down(&self, mut net: Network) {
        let errors = self.unwire(&net).await;
        self.recycle(&mut net).await;
        self.release_allocs(&net.rec);
        for error in errors {
            warn!(
                sandbox_id = net.rec.sandbox_id,
                tap = net.rec.tap_name,
                error,
                "teardown step failed"
            );
        }
    }

    async fn converge(&self, net: &mut Network, spec: NetworkSpec) -> Result<Ensured, AgentError> {
        if spec.idempotency_key.is_some() && spec.idempotency_key == net.rec.idempotency_key {
            return Ok(Ensured::Unchanged);
        }
        let sockets = self.host_sockets(&spec, &net.rec.port_mappings).await?;
        let Resolved {
            mappings,
            claimed,
            stale,
        } = {
            let mut a = self.allocs();
            resolve_ports(
                &mut a.ports,
                &spec.port_mappings,
                &net.rec.port_mappings,
                &self.port_rules(&sockets),
            )?
        };
        let mut rec = net.rec.clone();
        rec.port_mappings = mappings;
        rec.allow_internet_access = spec.allow_internet_access.unwrap_or(true);
        rec.allow_out = spec.allow_out;
        rec.deny_out = spec.deny_out;
        rec.metadata = spec.metadata;
        rec.mtu = spec.mtu.unwrap_or(self.cfg.mtu);
        rec.idempotency_key = spec.idempotency_key;
        if rec == net.rec {
            return Ok(Ensured::Unchanged);
        }
        let undo_claims = |this: &Self| {
            let mut a = this.allocs();
            for m in &claimed {
                a.ports.release(m.protocol, m.host_port);
            }
        };
        let old = std::mem::replace(&mut net.rec, rec);
        let result = self.apply_change(net, &old).await;
        if let Err(e) = result {
            net.rec = old;
            // Put the kernel side back the way it was (best effort).
            let _ = self.apply_change_kernel(net, None).await;
            undo_claims(self);
            return Err(e);
        }
        let mut a = self.allocs();
        for m in &stale {
            a.ports.release(m.protocol, m.host_port);
        }
        Ok(Ensured::Updated)
    }

    async fn apply_change(&self, net: &Network, old: &NetworkRecord) -> Result<(), AgentError> {
        self.apply_change_kernel(net, Some(old)).await?;
        self.store
            .put(&net.rec.sandbox_id, net.rec.to_bytes())
            .await
            .map_err(|e| failed("recording the network durably", &e))
    }

    async fn apply_change_kernel(
        &self,
        net: &Network,
        old: Option<&NetworkRecord>,
    ) -> Result<(), AgentError> {
        if old.is_none_or(|o| o.mtu != net.rec.mtu) {
            let change = LinkChange {
                mtu: Some(net.rec.mtu),
                ..Default::default()
            };
            self.nl
                .set_link(net.ifindex, change)
                .await
                .map_err(|e| failed(&format!("setting the MTU of {}", net.rec.tap_name), &e))?;
        }
        self.datapath
            .attach(&net.path())
            .map_err(|e| failed("programming the datapath", &e))
    }

    /// ReleaseNetwork: `Ok(false)` if there was no such network.
    pub async fn release(&self, id: &str) -> Result<bool, AgentError> {
        let started = Instant::now();
        validate_sandbox_id(id)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            match guard.take() {
                None => Ok(false),
                Some(net) => match self.store.delete(id).await {
                    Err(e) => {
                        *guard = Some(net);
                        Err(failed("removing the record", &e))
                    }
                    Ok(()) => {
                        self.remove_view(id);
                        let (tap, ip) = (net.rec.tap_name.clone(), net.rec.sandbox_ip);
                        self.tear_down(net).await;
                        info!(
                            sandbox_id = id,
                            tap,
                            sandbox_ip = %ip,
                            elapsed_us = started.elapsed().as_micros() as u64,
                            "network released"
                        );
                        Ok(true)
                    }
                },
            }
        };
        self.forget_slot(id, slot);
        result
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

    /// OpenTap: a fresh duplicate of the agent's TAP fd. A network adopted
    /// without an fd (the agent restarted without its fd store while a VMM
    /// held the TAP) gets its TAP re-attached here once the holder let go.
    pub async fn open_tap(&self, id: &str) -> Result<OwnedFd, AgentError> {
        validate_sandbox_id(id)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            match guard.as_mut() {
                None => Err(AgentError::NotFound(id.to_owned())),
                Some(net) => match self.reattach_fd(net) {
                    Err(e) => Err(e),
                    Ok(_) => match &net.tap {
                        Some(tap) => tap.dup().map_err(|e| failed("duplicating the TAP fd", &e)),
                        None => unreachable!("reattach_fd leaves an fd or fails"),
                    },
                },
            }
        };
        self.forget_slot(id, slot);
        result
    }

    /// Gives a network adopted without an fd its TAP back: TUNSETIFF on the
    /// device succeeds once no other process holds its (single) queue.
    /// `Ok(true)` if it re-attached now, `Ok(false)` if the fd was there.
    /// Called with the network's slot held.
    fn reattach_fd(&self, net: &mut Network) -> Result<bool, AgentError> {
        if net.tap.is_some() {
            return Ok(false);
        }
        match Tap::open_existing(&net.rec.tap_name) {
            Ok(tap) => {
                pool::store_fd(net.ifindex, &tap);
                net.tap = Some(tap);
                self.set_view(net);
                info!(
                    sandbox_id = net.rec.sandbox_id.as_str(),
                    tap = net.rec.tap_name.as_str(),
                    "TAP re-attached: the process that held it let go"
                );
                Ok(true)
            }
            Err(e) if e.errno() == Some(libc::EBUSY) => Err(AgentError::TapBusy {
                tap: net.rec.tap_name.clone(),
            }),
            Err(e) => Err(failed(&format!("re-opening TAP {}", net.rec.tap_name), &e)),
        }
    }

    /// The kernel announced a qdisc or filter removal on `r.ifindex`.
    fn note_tc_removal(&self, r: crate::netlink::TcRemoval) {
        self.datapath.forget_attachment(r.ifindex);
        let mut drift = self.drift.lock().unwrap_or_else(|p| p.into_inner());
        drift.insert(r.ifindex, r.what);
    }

    /// Compares the kernel with one filter the datapath keeps and attaches
    /// it again when the kernel lost it. `Ok(true)` if it had to.
    async fn repair_hook(&self, hook: &Hook) -> Result<bool, String> {
        let present = self
            .nl
            .has_bpf_filter(hook.ifindex, hook.hook, FILTER_PRIORITY)
            .await
            .map_err(|e| format!("checking {hook}: {}", crate::error_chain(&e)))?;
        if !present {
            self.datapath
                .reattach(hook)
                .map_err(|e| format!("re-attaching {hook}: {e}"))?;
        }
        self.drift
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&hook.ifindex);
        Ok(!present)
    }

    /// The kernel check of a network's TAP filter; a repair message if it
    /// had to re-attach it.
    async fn repair_tap_hook(&self, net: &Network) -> Result<Option<String>, String> {
        let Some(hook) = self.datapath.tap_hook(&net.rec.tap_name, net.ifindex) else {
            return Ok(None);
        };
        Ok(self.repair_hook(&hook).await?.then(|| {
            format!(
                "{}: {hook} was missing (clsact qdisc or filter removed), re-attached",
                net.rec.sandbox_id
            )
        }))
    }

    /// Guest-side facts for a network (same for every sandbox).
    pub fn describe(&self, view: NetworkView) -> NetworkInfo {
        let dev = "eth0".to_string();
        let gw = self.d.guest_gateway.to_string();
        let gw_mac = format_mac(&self.d.gateway_mac);
        NetworkInfo {
            view,
            guest_ip: format!("{}/{}", self.d.guest_ip, self.cfg.guest_prefix_len),
            gateway_ip: gw.clone(),
            guest_mac: format_mac(&self.d.guest_mac),
            gateway_mac: gw_mac.clone(),
            routes: vec![("0.0.0.0/0".into(), gw.clone(), dev.clone())],
            arp_neighbors: vec![(gw, gw_mac, dev)],
        }
    }

    pub fn active_networks(&self) -> u32 {
        self.views.read().unwrap_or_else(|p| p.into_inner()).len() as u32
    }

    pub fn idle_taps(&self) -> u32 {
        self.pool.idle() as u32
    }

    pub fn free_addresses(&self) -> u32 {
        self.allocs().ips.free()
    }

    /// Health: (healthy, checks).
    pub async fn health(&self) -> (bool, Vec<Check>) {
        let filters = self.filter_check().await;
        let mut checks: Vec<Check> = vec![];
        let st = self.store.stats();
        checks.push((
            "store".into(),
            true,
            format!(
                "{}: {} records, {} commits for {} writes",
                self.cfg.state_dir.display(),
                self.active_networks(),
                st.commits,
                st.ops
            ),
        ));
        checks.push((
            "gateway_device".into(),
            true,
            format!(
                "{} ({}) ifindex {} holds {}/{}",
                self.cfg.gateway_device,
                self.gateway.kind,
                self.gateway.ifindex,
                self.d.pool.gateway(),
                self.d.pool.prefix_len()
            ),
        ));
        checks.push(match &self.uplink {
            Uplink::Found {
                name,
                addr: Some(a),
                ..
            } => ("uplink".into(), true, format!("{name} {a}")),
            Uplink::Found {
                name, addr: None, ..
            } => (
                "uplink".into(),
                false,
                format!("{name} has no IPv4 address: SNAT egress is unavailable"),
            ),
            Uplink::Missing(why) => (
                "uplink".into(),
                false,
                format!("{why}: egress and port mappings are unavailable"),
            ),
        });
        let (free, cap) = {
            let a = self.allocs();
            (a.ips.free(), a.ips.capacity())
        };
        checks.push((
            "addresses".into(),
            free > 0,
            format!("{free} of {cap} free in {}", self.d.pool),
        ));
        let ps = self.pool.stats();
        let mut detail = format!(
            "{} idle of {} wanted, {} abnormal, {} quarantined, {} retiring; {} created, {} deleted",
            ps.idle,
            ps.target,
            ps.abnormal,
            ps.quarantined.len(),
            ps.retiring,
            ps.created,
            ps.deleted
        );
        for (name, why) in &ps.quarantined {
            detail.push_str(&format!("; quarantined {name}: {why}"));
        }
        if let Some(e) = &ps.last_error {
            detail.push_str(&format!("; last error: {e}"));
        }
        checks.push(("tap_pool".into(), ps.quarantined.is_empty(), detail));
        let r = &self.recovery;
        let mut detail = format!(
            "adopted {}, repaired {}, pool TAPs adopted {}, retired {}, stale neighbours {}, quarantined records {}, in {} ms",
            r.adopted,
            r.repaired,
            r.pool_adopted,
            r.retired,
            r.stale_neighbours,
            r.quarantined.len(),
            r.elapsed_ms
        );
        for q in r
            .quarantined
            .iter()
            .chain(&r.store_problems)
            .chain(&r.errors)
        {
            detail.push_str("; ");
            detail.push_str(q);
        }
        checks.push((
            "recovery".into(),
            r.quarantined.is_empty() && r.store_problems.is_empty() && r.errors.is_empty(),
            detail,
        ));
        checks.push(self.tap_fd_check());
        checks.extend(self.datapath.checks());
        checks.extend(filters);
        (checks.iter().all(|c| c.1), checks)
    }

    /// TAPs of live networks the agent holds no fd for (adopted after a
    /// restart without the fd store while a VMM held them). Not a fault:
    /// the VMM keeps forwarding; only OpenTap waits until it lets go, and
    /// OpenTap or Reconcile then take the TAP back. Computed from the live
    /// views, so a released network leaves no trace.
    fn tap_fd_check(&self) -> Check {
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        let held: Vec<&str> = views
            .values()
            .filter(|v| !v.tap_fd_held)
            .map(|v| v.record.sandbox_id.as_str())
            .collect();
        let detail = if held.is_empty() {
            format!("the agent holds the TAP fd of all {} networks", views.len())
        } else {
            format!(
                "{} of {} TAPs held only by another process since a restart without the fd store \
                 (OpenTap answers TapBusy until it closes them): {}",
                held.len(),
                views.len(),
                held.join(", ")
            )
        };
        ("tap_fds".into(), true, detail)
    }

    /// The datapath's filters as the kernel has them: every device the
    /// kernel announced a qdisc/filter removal on is checked again (a
    /// dump per such device, none in the normal case); what is still
    /// missing is reported until Reconcile (or a restart) re-attaches it.
    async fn filter_check(&self) -> Vec<Check> {
        let mut wanted = self.datapath.node_hooks();
        if wanted.is_empty() {
            return vec![];
        }
        let drifted: BTreeMap<u32, String> =
            self.drift.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let owners: HashMap<u32, String> = {
            let views = self.views.read().unwrap_or_else(|p| p.into_inner());
            for v in views
                .values()
                .filter(|v| drifted.contains_key(&v.tap_ifindex))
            {
                wanted.extend(self.datapath.tap_hook(&v.record.tap_name, v.tap_ifindex));
            }
            views
                .values()
                .map(|v| (v.tap_ifindex, v.record.sandbox_id.clone()))
                .collect()
        };
        let total_taps = owners.len();
        let mut missing = vec![];
        for hook in wanted.iter().filter(|h| drifted.contains_key(&h.ifindex)) {
            match self
                .nl
                .has_bpf_filter(hook.ifindex, hook.hook, FILTER_PRIORITY)
                .await
            {
                Ok(true) => {
                    self.drift
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&hook.ifindex);
                }
                Ok(false) => missing.push(format!(
                    "{hook}{} ({} removed)",
                    owners
                        .get(&hook.ifindex)
                        .map(|id| format!(" of {id}"))
                        .unwrap_or_default(),
                    drifted[&hook.ifindex]
                )),
                Err(e) => missing.push(format!("{hook}: cannot check: {}", crate::error_chain(&e))),
            }
        }
        // Devices that are neither node devices nor live TAPs any more.
        {
            let node: HashSet<u32> = wanted.iter().map(|h| h.ifindex).collect();
            let mut drift = self.drift.lock().unwrap_or_else(|p| p.into_inner());
            drift.retain(|i, _| node.contains(i) || owners.contains_key(i));
        }
        let detail = if missing.is_empty() {
            format!(
                "the kernel has every datapath filter ({} node hooks, from_guest on {total_taps} sandbox TAPs)",
                self.datapath.node_hooks().len()
            )
        } else {
            format!(
                "missing in the kernel: {}; ReconcileNetwork \"\" re-attaches them",
                missing.join("; ")
            )
        };
        vec![("datapath_filters".into(), missing.is_empty(), detail)]
    }

    /// ReconcileNetwork: re-checks one network ("" = all, plus orphan
    /// TAPs and stale neighbours) against the kernel and repairs drift.
    pub async fn reconcile(&self, id: &str) -> Result<ReconcileReport, AgentError> {
        let mut report = ReconcileReport::default();
        let ids: Vec<String> = if id.is_empty() {
            self.views
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .keys()
                .cloned()
                .collect()
        } else {
            validate_sandbox_id(id)?;
            self.get(id)?;
            vec![id.to_owned()]
        };
        let links = self
            .nl
            .list_links()
            .await
            .map_err(|e| failed("listing links", &e))?;
        let by_name: HashMap<&str, &LinkInfo> =
            links.iter().map(|l| (l.name.as_str(), l)).collect();
        let neighbours = self
            .nl
            .neigh_list(self.gateway.ifindex)
            .await
            .map_err(|e| failed("listing neighbours", &e))?;
        for id in &ids {
            let slot = self.slot(id);
            {
                let mut guard = slot.lock().await;
                if let Some(net) = guard.as_mut() {
                    report.checked += 1;
                    self.reconcile_one(net, &by_name, &neighbours, &mut report)
                        .await;
                    self.set_view(net);
                }
            }
            self.forget_slot(id, slot);
        }
        if id.is_empty() {
            for hook in self.datapath.node_hooks() {
                match self.repair_hook(&hook).await {
                    Ok(true) => report.repaired.push(format!(
                        "node: {hook} was missing (clsact qdisc or filter removed), re-attached"
                    )),
                    Ok(false) => {}
                    Err(e) => report.errors.push(format!("node: {e}")),
                }
            }
            self.collect_garbage(&links, &neighbours, &mut report).await;
        }
        info!(
            checked = report.checked,
            repaired = report.repaired.len(),
            removed = report.removed.len(),
            errors = report.errors.len(),
            "reconciled"
        );
        Ok(report)
    }

    async fn reconcile_one(
        &self,
        net: &mut Network,
        links: &HashMap<&str, &LinkInfo>,
        neighbours: &[(IpAddr, Option<[u8; 6]>, u16)],
        report: &mut ReconcileReport,
    ) {
        let id = net.rec.sandbox_id.clone();
        match links.get(net.rec.tap_name.as_str()) {
            None => {
                // The TAP vanished (deleted by hand): make a new one.
                net.tap = None;
                crate::systemd::remove_tap_fd(net.ifindex);
                match self.cold_tap(&net.rec.tap_name, net.rec.mtu).await {
                    Ok(pt) => {
                        net.ifindex = pt.ifindex;
                        net.tap = Some(pt.tap);
                        report.repaired.push(format!(
                            "{id}: TAP {} was missing, recreated",
                            net.rec.tap_name
                        ));
                    }
                    Err(e) => report.errors.push(format!("{id}: {e}")),
                }
            }
            Some(link) => {
                net.ifindex = link.index;
                if !link.up || link.mtu != net.rec.mtu {
                    let change = LinkChange {
                        mtu: Some(net.rec.mtu),
                        up: Some(true),
                        ..Default::default()
                    };
                    match self.nl.set_link(link.index, change).await {
                        Ok(()) => report.repaired.push(format!(
                            "{id}: TAP {} was {} with MTU {}, set up with MTU {}",
                            net.rec.tap_name,
                            if link.up { "up" } else { "down" },
                            link.mtu,
                            net.rec.mtu
                        )),
                        Err(e) => report
                            .errors
                            .push(format!("{id}: {}", crate::error_chain(&e))),
                    }
                }
            }
        }
        let has_neigh = neighbours
            .iter()
            .any(|(ip, mac, _)| *ip == net.rec.sandbox_ip && *mac == Some(self.d.guest_mac));
        if !has_neigh {
            match self
                .nl
                .neigh_replace_permanent(self.gateway.ifindex, net.rec.sandbox_ip, self.d.guest_mac)
                .await
            {
                Ok(()) => report.repaired.push(format!(
                    "{id}: neighbour entry for {} restored",
                    net.rec.sandbox_ip
                )),
                Err(e) => report
                    .errors
                    .push(format!("{id}: {}", crate::error_chain(&e))),
            }
        }
        // The kernel check first: `attach` alone would quietly re-attach a
        // filter the tc watcher reported removed, and Reconcile must say so.
        match self.repair_tap_hook(net).await {
            Ok(Some(what)) => report.repaired.push(what),
            Ok(None) => {}
            Err(e) => report.errors.push(format!("{id}: {e}")),
        }
        if let Err(e) = self.datapath.attach(&net.path()) {
            report.errors.push(format!("{id}: {e}"));
        }
        // A TAP adopted without an fd: take it back if its holder let go
        // (still held is not an error: the VMM is running).
        match self.reattach_fd(net) {
            Ok(true) => report.repaired.push(format!(
                "{id}: TAP {} re-attached (adopted without an fd, its holder let go)",
                net.rec.tap_name
            )),
            Ok(false) | Err(AgentError::TapBusy { .. }) => {}
            Err(e) => report.errors.push(format!("{id}: {e}")),
        }
    }

    /// Our TAPs and neighbour entries for pool addresses that nothing
    /// owns. The address allocator is the owner of record: an address is
    /// allocated from the start of a create (before its TAP is named or its
    /// neighbour added) until the end of a release, so "not allocated"
    /// cannot catch a network half-way through either.
    async fn collect_garbage(
        &self,
        links: &[LinkInfo],
        neighbours: &[(IpAddr, Option<[u8; 6]>, u16)],
        report: &mut ReconcileReport,
    ) {
        let unowned = |ip: Ipv4Addr| {
            self.d.pool.contains(ip)
                && ip != self.d.pool.gateway()
                && !self.allocs().ips.is_allocated(ip)
        };
        for link in links.iter().filter(|l| l.kind.as_deref() == Some("tun")) {
            if let spec::TapNameKind::Sandbox(ip) =
                spec::classify_tap_name(&self.cfg.tap_prefix, &link.name)
                && unowned(ip)
            {
                self.pool.retire_link(link.index);
                report.removed.push(format!("orphan TAP {}", link.name));
            }
        }
        for (ip, _, _) in neighbours {
            if let IpAddr::V4(v4) = ip
                && unowned(*v4)
            {
                match self.nl.neigh_del(self.gateway.ifindex, *ip).await {
                    Ok(()) => report.removed.push(format!("stale neighbour {ip}")),
                    Err(e) => report.errors.push(crate::error_chain(&e)),
                }
            }
        }
    }

    /// Start-up recovery: collect facts, classify, apply.
    async fn recover(
        &mut self,
        records: BTreeMap<String, Vec<u8>>,
        mut inherited: HashMap<String, Tap>,
    ) -> Result<RecoveryReport, StartError> {
        let mut report = RecoveryReport::default();
        let links = self.nl.list_links().await?;
        let neighbours = self.nl.neigh_list(self.gateway.ifindex).await?;
        let neigh_ips: Vec<IpAddr> = neighbours.iter().map(|n| n.0).collect();
        let plan = {
            let a = self.allocs.get_mut().unwrap_or_else(|p| p.into_inner());
            recover::classify(
                &self.cfg.tap_prefix,
                self.cfg.retire_group,
                records,
                &links,
                &neigh_ips,
                &mut a.ips,
                &mut a.ports,
            )
        };
        for (key, bytes, reason) in &plan.quarantine {
            warn!(sandbox_id = key, reason, "record quarantined");
            if let Err(e) = self.store.quarantine_record(key, bytes, reason).await {
                report
                    .errors
                    .push(format!("quarantining {key}: {}", crate::error_chain(&e)));
            }
            report.quarantined.push(format!("record {key}: {reason}"));
        }
        let neigh_ok: HashSet<IpAddr> = neighbours
            .iter()
            .filter(|n| n.1 == Some(self.d.guest_mac))
            .map(|n| n.0)
            .collect();
        let mut max_ip: Option<Ipv4Addr> = None;
        let total = plan.networks.len();
        for (done, (rec, link)) in plan.networks.into_iter().enumerate() {
            if let IpAddr::V4(v4) = rec.sandbox_ip {
                max_ip = max_ip.max(Some(v4));
            }
            let fd = link.as_ref().and_then(|l| inherited.remove(&l.name));
            let net = self.adopt(rec, link, fd, &neigh_ok, &mut report).await;
            if total > 1024 && done % 1024 == 0 {
                // Long recovery: ask systemd for more start-up time.
                crate::systemd::notify("EXTEND_TIMEOUT_USEC=10000000");
            }
            self.set_view(&net);
            self.slots
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    net.rec.sandbox_id.clone(),
                    Arc::new(AsyncMutex::new(Some(net))),
                );
        }
        if let Some(ip) = max_ip {
            self.allocs
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .ips
                .set_cursor_after(ip);
        }
        if let Some(n) = plan.max_pool_name {
            self.pool.continue_names_after(n);
        }
        for link in plan.pool {
            let tap = match inherited.remove(&link.name) {
                Some(tap) => Ok(tap),
                None => {
                    Tap::open_existing(&link.name).inspect(|tap| pool::store_fd(link.index, tap))
                }
            };
            match tap {
                Ok(tap) if !link.up && link.mtu == self.cfg.mtu => {
                    self.pool.adopt_idle(PoolTap {
                        tap,
                        ifindex: link.index,
                    });
                    report.pool_adopted += 1;
                }
                _ => {
                    self.pool.retire_link(link.index);
                    report.retired += 1;
                }
            }
        }
        // Inherited fds whose device is gone or no longer ours.
        for (name, tap) in inherited {
            let index = nix::net::if_::if_nametoindex(name.as_str()).unwrap_or(0);
            debug!(tap = name, "dropping an inherited fd nobody owns");
            drop(tap);
            if index != 0 {
                crate::systemd::remove_tap_fd(index);
            }
        }
        for link in plan.retire {
            info!(tap = link.name, "retiring unowned TAP");
            self.pool.retire_link(link.index);
            report.retired += 1;
        }
        for ip in plan.stale_neighbours {
            if let Err(e) = self.nl.neigh_del(self.gateway.ifindex, ip).await {
                report.errors.push(crate::error_chain(&e));
            } else {
                report.stale_neighbours += 1;
            }
        }
        self.pool.delete_retired().await;
        Ok(report)
    }

    /// Re-attaches one recorded network to its TAP, repairing what is off.
    async fn adopt(
        &self,
        rec: NetworkRecord,
        link: Option<LinkInfo>,
        inherited: Option<Tap>,
        neigh_ok: &HashSet<IpAddr>,
        report: &mut RecoveryReport,
    ) -> Network {
        let id = rec.sandbox_id.clone();
        let mut net = Network {
            rec,
            tap: None,
            ifindex: 0,
        };
        let mut repaired = false;
        match link {
            Some(link) => {
                net.ifindex = link.index;
                let opened = match inherited {
                    Some(tap) => Ok(tap),
                    None => Tap::open_existing(&link.name)
                        .inspect(|tap| pool::store_fd(link.index, tap)),
                };
                match opened {
                    Ok(tap) => net.tap = Some(tap),
                    Err(e) if e.errno() == Some(libc::EBUSY) => {
                        warn!(
                            sandbox_id = id,
                            tap = link.name,
                            "TAP held by another process; adopted without an fd"
                        );
                        report.fd_lost.push(id.clone());
                    }
                    Err(e) => report
                        .errors
                        .push(format!("{id}: {}", crate::error_chain(&e))),
                }
                if !link.up || link.mtu != net.rec.mtu {
                    let change = LinkChange {
                        mtu: Some(net.rec.mtu),
                        up: Some(true),
                        ..Default::default()
                    };
                    if let Err(e) = self.nl.set_link(link.index, change).await {
                        report
                            .errors
                            .push(format!("{id}: {}", crate::error_chain(&e)));
                    }
                    repaired = true;
                }
            }
            None => match self.cold_tap(&net.rec.tap_name, net.rec.mtu).await {
                Ok(pt) => {
                    net.ifindex = pt.ifindex;
                    net.tap = Some(pt.tap);
                    repaired = true;
                }
                Err(e) => report.errors.push(format!("{id}: {e}")),
            },
        }
        if !neigh_ok.contains(&net.rec.sandbox_ip) {
            if let Err(e) = self
                .nl
                .neigh_replace_permanent(self.gateway.ifindex, net.rec.sandbox_ip, self.d.guest_mac)
                .await
            {
                report
                    .errors
                    .push(format!("{id}: {}", crate::error_chain(&e)));
            }
            repaired = true;
        }
        // The kernel is the truth, not the pinned record of attachments.
        if net.ifindex != 0 {
            match self.repair_tap_hook(&net).await {
                Ok(Some(what)) => {
                    warn!(sandbox_id = id, "{what}");
                    repaired = true;
                }
                Ok(None) => {}
                Err(e) => report.errors.push(format!("{id}: {e}")),
            }
        }
        if let Err(e) = self.datapath.attach(&net.path()) {
            report.errors.push(format!("{id}: {e}"));
        }
        if repaired {
            report.repaired += 1;
        } else {
            report.adopted += 1;
        }
        net
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
