//! Start-up: configuration, store, gateway device, uplink, datapath, then
//! recovery (collect facts, classify with `recover::classify`, apply with
//! the shared repair ladder) before anything is served.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tokio::sync::Mutex as AsyncMutex;
use tracing::{debug, info, warn};

use super::events::Events;
use super::pool::{self, PoolTap, TapPool};
use super::spec::{AttachRecord, NetworkRecord};
use super::{
    Agent, Allocs, Committed, Gateway, Network, RecoveryReport, StartError, Uplink,
    kernel_reserved_ports, recover,
};
use crate::alloc::{IpAllocator, PortAllocator};
use crate::config::{Config, Derived};
use crate::datapath::{Datapath, Hook};
use crate::netlink::{LinkInfo, Netlink};
use crate::store::Store;
use crate::tap::Tap;

/// The `ip link` alias of the tc block anchor.
pub(super) const ANCHOR_ALIAS: &str = "cube-network-agent: tc block anchor";
/// The shaper device pair (egress limits, docs/datapath.md "Bandwidth").
pub(super) const SHAPER_DEVICE: &str = "cube-shp";
pub(super) const SHAPER_ALIAS: &str = "cube-network-agent: shaper";
/// Its MTU: any packet a sandbox may send (GSO packets pass whatever it).
const SHAPER_MTU: u32 = 65_535;

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
        // The host's own packets to sandbox addresses fit a sandbox's link
        // (the device itself keeps a larger MTU: sandboxes with a larger
        // one of their own send through it).
        if let Err(e) = nl
            .set_prefix_route_mtu(
                d.pool.network(),
                d.pool.prefix_len(),
                gw_link.index,
                d.pool.gateway(),
                cfg.mtu,
            )
            .await
        {
            warn!(error = %crate::error_chain(&e), "setting the MTU of the route to the pool");
        }
        let uplink = Self::find_uplink(&nl, &cfg.uplink).await;
        // The address NAT66 uses, then followed (`follow_uplink6`).
        let uplink6 = match &uplink {
            Uplink::Found {
                ifindex,
                addr: Some(_),
                ..
            } if cfg.ipv6 == crate::config::Ipv6Mode::Auto => {
                Self::uplink_ipv6(&nl, *ifindex).await
            }
            _ => None,
        };
        match &uplink {
            Uplink::Found { name, addr, .. } => {
                info!(uplink = name, address = ?addr, ipv6 = ?uplink6, "uplink")
            }
            Uplink::Missing(why) => warn!(
                reason = why.as_str(),
                "no uplink; egress and port mappings are unavailable"
            ),
        }
        // The verifier takes ~150 ms for the programs: they load on a
        // thread of their own while the kernel's links and neighbours are
        // dumped for recovery (~200 ms at 10,000 TAPs).
        let anchor = if cfg.datapath == crate::config::DatapathKind::Ebpf {
            Some(Self::block_anchor(&nl, &cfg.tc_block_anchor).await?)
        } else {
            None
        };
        let shaper = match (&anchor, &uplink) {
            (Some(_), Uplink::Found { .. }) => Self::shaper_devices(&nl).await,
            _ => None,
        };
        let pool6 = match anchor {
            Some(_) if cfg.ipv6 == crate::config::Ipv6Mode::Auto => {
                Self::route_pool6(&nl, gw_link.index, &d, cfg.mtu).await
            }
            _ => false,
        };
        let loading = {
            let (cfg, d, gw, uplink) = (cfg.clone(), d.clone(), gw_link.clone(), uplink.clone());
            tokio::task::spawn_blocking(move || {
                Self::build_datapath(
                    &cfg,
                    &d,
                    (&gw, pool6.then_some(d.ipv6_pool)),
                    (&uplink, uplink6),
                    anchor.as_ref(),
                    shaper,
                )
            })
        };
        let links = nl.list_links().await?;
        let neighbours = nl.neigh_list(gw_link.index).await?;
        let datapath = match loading.await {
            Ok(dp) => dp?,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        let mut excluded = d.reserved_ports.clone();
        excluded.extend(&kernel_reserved_ports());
        let allocs = Allocs {
            ips: IpAllocator::new(d.pool).expect("validated pool"),
            ports: PortAllocator::new(d.port_low, d.port_high, excluded),
            bw: Committed::default(),
        };
        let events = Arc::new(Events::default());
        let pool = Arc::new(TapPool::new(
            nl.clone(),
            Netlink::new()?,
            pool::PoolSettings {
                prefix: cfg.tap_prefix.clone(),
                mtu: cfg.mtu,
                target: cfg.warm_pool as usize,
                retire_group: cfg.retire_group,
            },
            datapath.clone(),
            events.clone(),
        ));
        let flow_log = if cfg.flow_events {
            cfg.flow_log
        } else {
            crate::config::FlowLog::Off
        };
        let dns_names = super::dns_names::NameLog::new(&cfg.state_dir);
        let mut agent = Agent {
            cfg,
            d,
            nl,
            store,
            allocs: Mutex::new(allocs),
            slots: Mutex::new(HashMap::new()),
            views: RwLock::new(BTreeMap::new()),
            by_ifindex: RwLock::new(HashMap::new()),
            link_faults: Mutex::new(BTreeMap::new()),
            kernel_checks: Default::default(),
            pool,
            datapath,
            gateway: Gateway {
                ifindex: gw_link.index,
                kind,
                pool6,
            },
            uplink,
            uplink6: std::sync::RwLock::new(uplink6),
            recovery: RecoveryReport::default(),
            events,
            drift: Mutex::new(BTreeMap::new()),
            netns_owners: Mutex::new(HashMap::new()),
            reservations: Mutex::new(HashMap::new()),
            serving: std::sync::atomic::AtomicBool::new(false),
            egress: Default::default(),
            flows: crate::flows::FlowHub::new(Default::default(), flow_log),
            dns_names,
            flow_ends_seen: Mutex::new(Default::default()),
        };
        // Subscribe before recovery checks the kernel, so a filter removed
        // after that check is still noticed.
        let (tc_tx, mut tc_rx) = tokio::sync::mpsc::unbounded_channel();
        crate::netlink::watch_tc_removals(tc_tx)?;
        // Link events from before the networks are adopted are judged
        // against the kernel when they are handled (after recovery).
        let (link_tx, mut link_rx) = tokio::sync::mpsc::unbounded_channel();
        crate::netlink::watch_links(link_tx)?;
        // The uplink's IPv6 (NAT66) followed from the start on.
        let (v6_tx, v6_rx) = tokio::sync::mpsc::unbounded_channel();
        crate::netlink::watch_ipv6_addrs_and_routes(v6_tx)?;
        // The node's own addresses (node_addrs) followed likewise.
        let (addr_tx, mut addr_rx) = tokio::sync::mpsc::unbounded_channel();
        crate::netlink::watch_addrs(addr_tx)?;
        let mut inherited_taps: HashMap<String, Tap> = HashMap::new();
        for fd in inherited {
            match Tap::from_fd(fd) {
                Ok(tap) => {
                    inherited_taps.insert(tap.name().to_owned(), tap);
                }
                Err(e) => warn!(error = crate::error_chain(&e), "ignoring an inherited fd"),
            }
        }
        let mut report = agent
            .recover(loaded.records, inherited_taps, links, neighbours)
            .await?;
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
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            while let Some(ev) = link_rx.recv().await {
                let Some(agent) = weak.upgrade() else { break };
                agent.note_link(ev).await;
            }
        });
        // Fill the pool before serving so the first calls are warm, then
        // keep it topped up in the background.
        agent.pool.refill().await;
        agent
            .serving
            .store(true, std::sync::atomic::Ordering::Release);
        tokio::spawn(agent.pool.clone().run());
        tokio::spawn(agent.clone().run_ipv6(v6_rx));
        // The node's addresses into node_addrs: on every change (settled
        // for 50 ms: an address comes with several notifications), and
        // every minute in case a notification was lost.
        let dp = agent.datapath.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
            loop {
                tokio::select! {
                    poke = addr_rx.recv() => {
                        if poke.is_none() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        while addr_rx.try_recv().is_ok() {}
                    }
                    _ = tick.tick() => {}
                }
                let dp = dp.clone();
                let r = tokio::task::spawn_blocking(move || {
                    // A failed read keeps what the maps hold (an empty one
                    // would open the node's addresses to the sandboxes).
                    super::egress::read_local_addresses()
                        .map_err(|e| format!("reading them: {e}"))
                        .and_then(|a| dp.set_node_addrs(&a).map_err(|e| e.to_string()))
                })
                .await;
                match r {
                    Ok(Ok(n)) if n > 0 => debug!(changed = n, "node addresses followed"),
                    Ok(Err(e)) => warn!(error = %e, "node addresses not followed"),
                    _ => {}
                }
            }
        });
        agent.spawn_wake_reader();
        // CNI networks whose container's namespace went without a DEL.
        agent.spawn_gone_netns_reaper();
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            if let Some(agent) = weak.upgrade() {
                agent.egress_restore().await;
                // The flow log after the learned names are back: the
                // events the ring kept while the agent was down are named.
                agent.spawn_flow_log();
            }
            // Then, every 30 s, what the learned map holds beyond what is
            // tracked (earlier owners', entries no answer accounts for).
            loop {
                let Some(agent) = weak.upgrade() else { return };
                agent.egress_reap().await;
                agent.dns_names_tidy();
                drop(agent);
                tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            }
        });
        // Freed heap pages go back to the kernel every 5 s while networks
        // change (requests' temporaries, replies, signals): glibc keeps
        // them inside its heap otherwise. Nothing to do when idle.
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            let mut trimmed_at = 0;
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                let Some(agent) = weak.upgrade() else { return };
                let last = agent.events.last();
                drop(agent);
                if last != trimmed_at {
                    trimmed_at = last;
                    // SAFETY: malloc_trim(3) only returns free memory of
                    // the allocator's own heaps to the kernel.
                    let _ = tokio::task::spawn_blocking(|| unsafe { libc::malloc_trim(0) }).await;
                }
            }
        });
        let dp = agent.datapath.clone();
        // The first pass runs at once (off the start path: READY does not
        // wait for it), so Health's TAP and flow counts are right within
        // moments of a start, then every 2 s.
        tokio::spawn(async move {
            loop {
                let pass = dp.clone();
                if let Err(e) = tokio::task::spawn_blocking(move || pass.maintain()).await
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "the datapath's housekeeping pass panicked");
                }
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        });
        Ok(agent)
    }

    /// The device that keeps the shared tc block alive: a persistent TAP
    /// of the agent's, never up, marked with [`ANCHOR_ALIAS`]. An existing
    /// device of that name is adopted only if it is one (or a down TAP
    /// without an alias: created by an agent that stopped before marking
    /// it).
    async fn block_anchor(nl: &Netlink, name: &str) -> Result<LinkInfo, StartError> {
        let link = match nl.link_by_name(name).await? {
            Some(link) => link,
            None => {
                Tap::create(name).map_err(|e| {
                    StartError::Anchor(format!("creating '{name}': {}", crate::error_chain(&e)))
                })?;
                if let Err(error) = crate::sysctl::disable_ipv6(name) {
                    debug!(device = name, %error, "could not disable IPv6 on the anchor");
                }
                nl.link_by_name(name).await?.ok_or_else(|| {
                    StartError::Anchor(format!("'{name}' vanished right after it was created"))
                })?
            }
        };
        match (link.kind.as_deref(), link.alias.as_deref()) {
            (_, Some(ANCHOR_ALIAS)) => Ok(link),
            // Created by an agent that stopped before marking it: a TAP
            // nobody brought up (anything else of that name is not ours).
            (Some("tun"), None) if !link.up => {
                nl.set_link(
                    link.index,
                    crate::netlink::LinkChange {
                        alias: Some(ANCHOR_ALIAS),
                        ..Default::default()
                    },
                )
                .await?;
                Ok(link)
            }
            (kind, alias) => Err(StartError::Anchor(format!(
                "'{name}' exists ({}{}) and is not the agent's tc block anchor (alias \
                 '{ANCHOR_ALIAS}'); remove it or set tc_block_anchor to a free name",
                kind.unwrap_or("device"),
                alias.map(|a| format!(", alias '{a}'")).unwrap_or_default()
            ))),
        }
    }

    /// The shaper device pair, `cube-shp` ↔ `cube-shp-r` (made once, kept
    /// across restarts, up, no addresses, marked with [`SHAPER_ALIAS`]):
    /// (shaper ifindex, peer ifindex). None, with a warning, if a device of
    /// either name is someone else's: egress limits are then refused.
    async fn shaper_devices(nl: &Netlink) -> Option<(u32, u32)> {
        let peer = format!(
            "{SHAPER_DEVICE}{}",
            crate::datapath::ebpf::SHAPER_PEER_SUFFIX
        );
        let found = (
            nl.link_by_name(SHAPER_DEVICE).await.ok()?,
            nl.link_by_name(&peer).await.ok()?,
        );
        let ours = |l: &LinkInfo| {
            l.kind.as_deref() == Some("veth") && l.alias.as_deref() == Some(SHAPER_ALIAS)
        };
        let (a, b) = match found {
            (Some(a), Some(b)) if ours(&a) && ours(&b) => (a.index, b.index),
            (None, None) => {
                if let Err(e) = nl.create_veth_pair(SHAPER_DEVICE, &peer, SHAPER_MTU).await {
                    warn!(error = %crate::error_chain(&e), "creating the shaper devices; egress limits are unavailable");
                    return None;
                }
                let a = nl.link_by_name(SHAPER_DEVICE).await.ok()??.index;
                let b = nl.link_by_name(&peer).await.ok()??.index;
                (a, b)
            }
            _ => {
                warn!(
                    device = SHAPER_DEVICE,
                    peer,
                    "a device of the shaper's names is not the agent's; egress limits are unavailable"
                );
                return None;
            }
        };
        for (index, name) in [(a, SHAPER_DEVICE), (b, peer.as_str())] {
            if let Err(error) = crate::sysctl::disable_ipv6(name) {
                debug!(device = name, %error, "could not disable IPv6 on the shaper device");
            }
            let change = crate::netlink::LinkChange {
                up: Some(true),
                alias: Some(SHAPER_ALIAS),
                ..Default::default()
            };
            if let Err(e) = nl.set_link(index, change).await {
                warn!(device = name, error = %crate::error_chain(&e), "bringing the shaper device up; egress limits are unavailable");
                return None;
            }
        }
        Some((a, b))
    }

    /// The configured datapath; if the eBPF one cannot load, networks still
    /// get TAPs and addresses and Health says why packets do not flow —
    /// unless the failure is fatal (a pinned map it cannot migrate), which
    /// stops the start with the running datapath left as it is.
    pub(super) fn build_datapath(
        cfg: &Config,
        d: &Derived,
        (gw, pool6): (&LinkInfo, Option<[u8; 12]>),
        (uplink, uplink6): (&Uplink, Option<std::net::Ipv6Addr>),
        anchor: Option<&LinkInfo>,
        shaper: Option<(u32, u32)>,
    ) -> Result<Arc<dyn Datapath>, StartError> {
        let Some(anchor) = anchor.filter(|_| cfg.datapath == crate::config::DatapathKind::Ebpf)
        else {
            return Ok(Arc::new(crate::datapath::NoopDatapath::configured()));
        };
        // From netlink, not /sys/class/net: a sysfs mounted for another
        // namespace (systemd-nspawn's) has no such file, and a zero MAC
        // made the kernel drop every guest -> host packet as not ours.
        let (gwdev, gwdev_ifindex) = (gw.name.as_str(), gw.index);
        let gwdev_mac = gw.mac.unwrap_or([0; 6]);
        if gwdev_mac == [0; 6] {
            warn!(
                device = gwdev,
                "the gateway device has no MAC address: guest -> host traffic will be dropped"
            );
        }
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
                    ..
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
            block: cfg.tc_block,
            anchor: (anchor.name.clone(), anchor.index),
            hflow_shares: crate::datapath::maps::HflowShares::for_pool(
                d.pool.size().saturating_sub(3).min(u64::from(u32::MAX)) as u32,
            ),
            host_access_uids: cfg.host_access_uids.clone(),
            shaper: shaper.map(|(s, _)| (SHAPER_DEVICE.to_owned(), s)),
            shaper_peer: shaper.map(|(_, p)| p),
            ipv6_link: cfg.ipv6 == crate::config::Ipv6Mode::Auto,
            flow_events: cfg.flow_events,
            deny_reject: cfg.deny_action == crate::config::DenyAction::Reject,
            uplink_ip6: uplink6,
            pool6,
            pool_mask: prefix_mask(d.pool.prefix_len()),
            node_addrs: super::egress::local_addresses(),
        };
        match crate::datapath::ebpf::EbpfDatapath::load(node) {
            Ok(dp) => Ok(Arc::new(dp)),
            Err(e) if e.fatal => Err(e.into()),
            Err(e) => {
                warn!(error = %e, "the eBPF datapath could not be loaded");
                Ok(Arc::new(crate::datapath::NoopDatapath::failed(
                    &e.to_string(),
                )))
            }
        }
    }

    /// Host <-> sandbox over IPv6 (docs/dual-stack.md): the gateway
    /// device's address in `ipv6_pool` (a /128 without DAD), the gateway's
    /// link-local address as a permanent neighbour, and the pool's /96
    /// routed via it with the sandboxes' MTU (one route and neighbour for
    /// every sandbox; the datapath translates). False, warned, where the
    /// node cannot (IPv6 disabled on the device).
    async fn route_pool6(nl: &Netlink, ifindex: u32, d: &Derived, mtu: u32) -> bool {
        match Self::pool6_setup(nl, ifindex, d, mtu).await {
            Ok(()) => {
                info!(
                    address = %d.pool6_addr(d.pool.gateway()),
                    pool = %format!("{}/96", d.pool6_addr(std::net::Ipv4Addr::UNSPECIFIED)),
                    "host <-> sandbox over IPv6"
                );
                true
            }
            Err(e) => {
                warn!(error = %crate::error_chain(&e), "routing ipv6_pool to the gateway device: the host reaches sandboxes over IPv4 only");
                false
            }
        }
    }

    /// [`Self::route_pool6`]'s kernel state, made or remade (idempotent;
    /// also Reconcile's repair).
    pub(super) async fn pool6_setup(
        nl: &Netlink,
        ifindex: u32,
        d: &Derived,
        mtu: u32,
    ) -> Result<(), crate::netlink::NetlinkError> {
        let host6 = d.pool6_addr(d.pool.gateway());
        let via = crate::types::link_local(&d.gateway_mac);
        let prefix = d.pool6_addr(std::net::Ipv4Addr::UNSPECIFIED);
        nl.add_ipv6_addr_nodad(ifindex, host6, 128).await?;
        nl.neigh_replace_permanent(ifindex, via.into(), d.guest_mac)
            .await?;
        nl.replace_ipv6_route_via((prefix, 96), via, ifindex, host6, mtu)
            .await
    }

    /// The uplink's NAT66 address (see [`Netlink::ipv6_egress_addr`]); a
    /// failure to read it is no IPv6 egress, logged.
    async fn uplink_ipv6(nl: &Netlink, ifindex: u32) -> Option<std::net::Ipv6Addr> {
        match nl.ipv6_egress_addr(ifindex).await {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %crate::error_chain(&e), "reading the uplink's IPv6 addresses: no IPv6 egress");
                None
            }
        }
    }

    pub(super) async fn find_uplink(nl: &Netlink, configured: &str) -> Uplink {
        if configured.is_empty() {
            return match nl.default_uplink().await {
                Ok(Some((link, addr))) => Uplink::Found {
                    name: link.name,
                    ifindex: link.index,
                    addr,
                    mtu: link.mtu,
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
                    mtu: link.mtu,
                }
            }
            Ok(None) => Uplink::Missing(format!("configured uplink '{configured}' does not exist")),
            Err(e) => Uplink::Missing(crate::error_chain(&e)),
        }
    }

    /// Start-up recovery: collect facts, classify, apply.
    pub(super) async fn recover(
        &mut self,
        records: BTreeMap<String, Vec<u8>>,
        mut inherited: HashMap<String, Tap>,
        links: Vec<LinkInfo>,
        neighbours: Vec<(IpAddr, Option<[u8; 6]>, u16)>,
    ) -> Result<RecoveryReport, StartError> {
        let mut report = RecoveryReport::default();
        let neigh_ips: Vec<IpAddr> = neighbours.iter().map(|n| n.0).collect();
        let plan = {
            let a = self.allocs.get_mut().unwrap_or_else(|p| p.into_inner());
            let plan = recover::classify(
                &self.cfg.tap_prefix,
                self.cfg.retire_group,
                records,
                &links,
                &neigh_ips,
                &mut a.ips,
                &mut a.ports,
            );
            let mut bw = Committed::default();
            for (rec, _) in &plan.networks {
                bw.add(&rec.bandwidth);
            }
            a.bw = bw;
            plan
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
        // The kernel, not the pinned record of attachments, says whether
        // each TAP still runs `from_guest` (bound to the shared block). The
        // devices are the ones the plan found; a TAP the ladder has to
        // recreate is attached there.
        let hooks: Vec<(String, Hook)> = plan
            .networks
            .iter()
            .filter_map(|(rec, link)| {
                // TAPs and veth host ends alike carry the guest filter.
                let link = link.as_ref()?;
                let hook = self.datapath.tap_hook(&rec.tap_name, link.index)?;
                Some((rec.sandbox_id.clone(), hook))
            })
            .collect();
        // On a thread of its own while the networks are adopted below (a
        // request per TAP, ~150 ms at 10,000). Adoption does not bind a
        // recorded TAP again, so what the check finds missing is attached
        // after it and counted as a repair.
        let check = {
            let dp = self.datapath.clone();
            let wanted: Vec<Hook> = hooks.iter().map(|(_, h)| h.clone()).collect();
            tokio::task::spawn_blocking(move || {
                let t = Instant::now();
                (dp.check(&wanted), t.elapsed())
            })
        };
        let adopting = Instant::now();
        // Networks the adoption counted as repaired.
        let mut repaired_ids: HashSet<String> = HashSet::new();
        for (done, (rec, link)) in plan.networks.into_iter().enumerate() {
            if let IpAddr::V4(v4) = rec.sandbox_ip {
                max_ip = max_ip.max(Some(v4));
            }
            let fd = link.as_ref().and_then(|l| inherited.remove(&l.name));
            let repaired_before = report.repaired;
            let net = self.adopt(rec, link, fd, &neigh_ok, &mut report).await;
            if report.repaired > repaired_before {
                repaired_ids.insert(net.rec.sandbox_id.clone());
            }
            if total > 1024 && done % 1024 == 0 {
                // Long recovery: ask systemd for more start-up time.
                crate::systemd::notify("EXTEND_TIMEOUT_USEC=10000000");
            }
            self.set_view(&net);
            if let AttachRecord::Veth {
                netns: Some(ns), ..
            } = &net.rec.attach
            {
                self.netns_owners
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(*ns, net.rec.sandbox_id.clone());
            }
            self.slots
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    net.rec.sandbox_id.clone(),
                    Arc::new(AsyncMutex::new(Some(net))),
                );
        }
        let adopt_ms = adopting.elapsed().as_millis() as u64;
        let (checked, check_took) = match check.await {
            Ok(result) => result,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        info!(
            hooks = hooks.len(),
            check_ms = check_took.as_millis() as u64,
            adopt_ms,
            "datapath hooks checked while the networks were adopted"
        );
        match checked {
            Ok(missing) => {
                for (i, why) in missing {
                    let (id, hook) = &hooks[i];
                    match self.datapath.reattach(hook) {
                        Ok(()) => {
                            warn!(
                                sandbox_id = id.as_str(),
                                "recovery: {hook}: {why}; attached again"
                            );
                            if repaired_ids.insert(id.clone()) {
                                report.adopted -= 1;
                                report.repaired += 1;
                            }
                        }
                        Err(e) => report
                            .errors
                            .push(format!("{id}: re-attaching {hook}: {e}")),
                    }
                }
            }
            Err(e) => report.errors.push(format!(
                "checking the TAPs' filters: {}",
                crate::error_chain(&e)
            )),
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
                    // An idle TAP an older build gave a qdisc and filter of
                    // its own joins the shared block (nobody but this agent
                    // ever held it: nothing can flow while it changes).
                    if self
                        .datapath
                        .tap_hook(&link.name, link.index)
                        .is_some_and(|h| matches!(h.place, crate::datapath::Place::Filter(_)))
                        && let Err(e) = self.datapath.prepare_idle_tap(&link.name, link.index)
                    {
                        warn!(tap = link.name, error = %e, "binding an idle TAP to the tc block failed");
                    }
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
            match self.nl.neigh_del(self.gateway.ifindex, ip).await {
                Ok(true) => report.stale_neighbours += 1,
                Ok(false) => {}
                Err(e) => report.errors.push(crate::error_chain(&e)),
            }
        }
        self.pool.delete_retired().await;
        Ok(report)
    }

    /// Re-attaches one recorded network to its TAP (the fd the service
    /// manager handed back, else the device itself), then runs the repair
    /// ladder Reconcile uses.
    pub(super) async fn adopt(
        &self,
        rec: NetworkRecord,
        link: Option<LinkInfo>,
        inherited: Option<Tap>,
        neigh_ok: &HashSet<IpAddr>,
        report: &mut RecoveryReport,
    ) -> Network {
        let id = rec.sandbox_id.clone();
        let neighbour_ok = neigh_ok.contains(&rec.sandbox_ip);
        // The fd the service manager handed back, else the device itself
        // (a plain adoption, not a repair; EBUSY: a VMM holds it).
        let is_tap = rec.attach.is_tap();
        // A TAP handed over by name is adopted by name, never opened: its
        // VMM may hold it, or attach to it at any time.
        let holds_fd = is_tap && !rec.by_name();
        let tap = inherited.filter(|_| holds_fd).or_else(|| {
            let link = link.as_ref().filter(|_| holds_fd)?;
            Tap::open_existing(&link.name)
                .inspect(|tap| pool::store_fd(link.index, tap))
                .ok()
        });
        let mut net = Network {
            rec: Arc::new(rec),
            tap,
            ifindex: link.as_ref().map_or(0, |l| l.index),
            // What an earlier run handed out is not known: a VMM may hold
            // the TAP, so its release deletes it.
            handed_out: is_tap,
        };
        let done = self
            .repair_ladder(&mut net, link, neighbour_ok, false)
            .await;
        if holds_fd && net.tap.is_none() && done.errors.is_empty() {
            warn!(
                sandbox_id = id,
                tap = net.rec.tap_name,
                "TAP held by another process; adopted without an fd"
            );
            report.fd_lost.push(id.clone());
        }
        for what in done.repairs.iter().chain(&done.gone) {
            warn!(sandbox_id = id, "recovery: {what}");
        }
        report.errors.extend(done.errors);
        if done.repairs.is_empty() {
            report.adopted += 1;
        } else {
            report.repaired += 1;
        }
        net
    }
}

/// The netmask of a prefix length.
fn prefix_mask(len: u8) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0))
}
