//! A sandbox's entries: `sandboxes`, `by_ip` (with the owner's
//! generation), policy keys and port mappings, written transactionally
//! (journalled, rolled back on any failure) and removed on release.

use super::*;

/// The last generation handed out by this process (see [`new_generation`]).
pub(super) static LAST_GENERATION: AtomicU64 = AtomicU64::new(0);

/// A generation for a new owner of a sandbox address: CLOCK_MONOTONIC in
/// nanoseconds, strictly above every generation this process handed out
/// or found in `by_ip` at load. The clock only moves forward within a
/// boot and pinned maps (bpffs) do not outlive one, so a generation is
/// never handed out twice, across agent restarts included, and nothing
/// but the pinned entries is needed to interpret one.
pub(super) fn new_generation() -> u64 {
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

fn proto_num(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => libc::IPPROTO_TCP as u8,
        Protocol::Udp => libc::IPPROTO_UDP as u8,
    }
}

/// One change `attach` made, with what to put back.
enum Undo {
    Sandbox(u32, Option<DpSandbox>),
    ByIp(u32, Option<DpTap>),
    Rate(u32, Option<DpRate>),
    /// Added by this call: removed on rollback.
    Policy(Added<DpPolicyData>),
    Policy6(Added<DpPolicy6Data>),
    Portmap(DpPortmapKey, Option<DpPortmapVal>),
}

pub(super) fn map_err(what: &'static str, e: &aya::maps::MapError) -> DatapathError {
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
/// wildcard (0) of both families; an IPv6 one ("::" or the uplink's
/// address, as the agent validated) is the wildcard of IPv6 only
/// (`DP_PM_V6_ONLY`: the datapath maps IPv6 on the uplink's address).
fn portmap_entries(
    ip: u32,
    mappings: &[crate::types::PortMapping],
    wins: bool,
) -> Result<Vec<(DpPortmapKey, DpPortmapVal)>, DatapathError> {
    let wins = if wins { DP_PM_WINS } else { 0 };
    mappings
        .iter()
        .map(|m| {
            let (host, flags) = match m.host_ip.parse::<std::net::IpAddr>() {
                _ if m.host_ip.is_empty() => (Ipv4Addr::UNSPECIFIED, 0),
                Ok(std::net::IpAddr::V4(a)) => (a, 0),
                Ok(std::net::IpAddr::V6(_)) => (Ipv4Addr::UNSPECIFIED, DP_PM_V6_ONLY),
                Err(_) => {
                    return Err(err(
                        "port_mappings",
                        format!(
                            "host_ip '{}' of {} {} is not an IP address",
                            m.host_ip, m.protocol, m.host_port
                        ),
                    ));
                }
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
                    flags: flags | wins,
                },
            ))
        })
        .collect()
}

/// A sandbox's classes in the uplink's shaper, from its index in the
/// pool (stable across restarts, unique per address): three minors each,
/// below the ones tc sets aside (0xffe0 and up), so a pool of up to 21,836
/// sandboxes (a /18 holds 16,382) can limit every one.
pub(super) fn uplink_tree(sandbox_ip: u32, host_ip: u32) -> Option<shaper::Tree> {
    let index = u32::from_be(sandbox_ip).checked_sub(u32::from_be(host_ip))? + 1;
    let base = index.checked_mul(3)?;
    (base + 3 < 0xffe0).then(|| shaper::Tree {
        parent: SHAPER_HANDLE | (base + 1),
        small: SHAPER_HANDLE | (base + 2),
        bulk: SHAPER_HANDLE | (base + 3),
    })
}

/// The shapers a sandbox's limits have: its classes in the uplink's
/// (egress), one on its own device (ingress).
#[derive(Debug, Default)]
pub(super) struct Shape {
    egress: Option<shaper::Tree>,
    ingress: bool,
}

impl Shape {
    /// The sandbox's `sb_rate` entry (None: no limit).
    fn rate(&self) -> Option<DpRate> {
        if self.egress.is_none() && !self.ingress {
            return None;
        }
        Some(DpRate {
            out_small: self.egress.map_or(0, |t| t.small),
            out_bulk: self.egress.map_or(0, |t| t.bulk),
            in_shaped: u32::from(self.ingress),
            pad: 0,
        })
    }
}

fn burst(b: u64) -> u64 {
    crate::types::Bandwidth::burst_or_default(b)
}

/// The sum of a tree's two leaves' statistics in `all`.
pub(super) fn leaves(
    all: &StdHashMap<u32, shaper::ClassStats>,
    t: shaper::Tree,
) -> shaper::ClassStats {
    [t.small, t.bulk]
        .iter()
        .filter_map(|id| all.get(id))
        .fold(shaper::ClassStats::default(), |a, s| a.plus(*s))
}

/// The tree on a sandbox's own device (the datapath's fixed ids).
pub(super) const TAP_TREE: shaper::Tree = shaper::Tree {
    parent: TAP_CLASS_PARENT,
    small: TAP_CLASS_SMALL,
    bulk: TAP_CLASS_BULK,
};

impl EbpfDatapath {
    /// Transactional: every entry written is journalled with what it
    /// replaced, and if any write fails the journal is played back, so a
    /// failed attach leaves exactly the previous state (a new sandbox has
    /// no entry at all, a converge keeps its previous ones in force).
    /// Entries the new state no longer wants are removed only once every
    /// write succeeded.
    pub(super) fn write_sandbox(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        let IpAddr::V4(v4) = sb.sandbox_ip else {
            return Err(err(
                "sandbox address",
                "IPv6 is not supported by the datapath yet",
            ));
        };
        let ip = ip_be(v4);
        let ifindex = sb.tap_ifindex;
        // Everything that can be refused is checked before the first write.
        let want4 = (
            policy::keys4(ip, sb.allow_out, false),
            policy::keys4(ip, sb.deny_out, true),
        );
        let want6 = (
            policy::keys6(ip, sb.allow_out, false),
            policy::keys6(ip, sb.deny_out, true),
        );
        let want_ports = portmap_entries(ip, sb.port_mappings, sb.mapping_wins)?;
        let before = self
            .rate_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex, 0)
            .ok();
        let shape = self.shape(sb, ip);
        let mut guard = self.lock();
        let inner = &mut *guard;
        self.ensure_filter(inner, ifindex)?;
        let mut journal = Vec::new();
        let result = Self::write_entries(
            inner,
            &mut journal,
            (ip, ifindex),
            sb,
            &shape,
            (&want4, &want6),
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
        inner.policy4.commit(ip, want4);
        inner.policy6.commit(ip, want6);
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
        if !wanted.is_empty() {
            inner.portmaps.insert(ip, wanted.into_iter().collect());
        }
        debug!(
            sandbox_id = sb.sandbox_id,
            tap = sb.tap_name,
            ifindex,
            "datapath entries written"
        );
        drop(guard);
        self.unshape_leftovers(sb, &shape, before);
        Ok(())
    }

    /// Sets up the shapers `sb`'s limits need (before its entries point
    /// packets at them): the sandbox's classes in the shaper device's HTB
    /// (made at its root the first time) for an egress limit, a root and
    /// classes on its device for an ingress limit. Idempotent (recovery
    /// and converges call it again). Never fails the attach: a direction
    /// whose shaper cannot be set up (no uplink or shaper device, a root
    /// qdisc of someone else's, a netlink error) is left unshaped and
    /// reported by Health's `bandwidth` check until an attach succeeds;
    /// the agent refuses a limit it knows it cannot enforce beforehand
    /// (`Datapath::shapes`).
    fn shape(&self, sb: &SandboxPath<'_>, ip: u32) -> Shape {
        let bw = &sb.bandwidth;
        let mut shape = Shape::default();
        let mut faults = vec![];
        if !bw.is_unlimited() {
            match tc::Conn::new() {
                Ok(mut conn) => {
                    if bw.egress_bps != 0 {
                        match self.shape_egress(&mut conn, bw, ip) {
                            Ok(tree) => shape.egress = Some(tree),
                            Err(why) => faults.push(format!("egress: {why}")),
                        }
                    }
                    if bw.ingress_bps != 0 {
                        let r = shaper::ensure_root(
                            &mut conn,
                            sb.tap_ifindex,
                            sb.tap_name,
                            TAP_TREE.bulk & 0xffff,
                        )
                        .and_then(|()| {
                            shaper::set_tree(
                                &mut conn,
                                sb.tap_ifindex,
                                TAP_TREE,
                                bw.ingress_bps,
                                burst(bw.ingress_burst),
                            )
                        });
                        match r {
                            Ok(()) => shape.ingress = true,
                            Err(e) => faults.push(format!("ingress: {e}")),
                        }
                    }
                }
                Err(e) => faults.push(format!("a netlink socket: {e}")),
            }
        }
        let mut f = self.shaper_faults.lock().unwrap_or_else(|p| p.into_inner());
        if faults.is_empty() {
            f.remove(&sb.tap_ifindex);
        } else {
            let why = format!("{}: {}", sb.sandbox_id, faults.join("; "));
            warn!(
                sandbox_id = sb.sandbox_id,
                why, "a bandwidth limit is not enforced"
            );
            f.insert(sb.tap_ifindex, why);
        }
        shape
    }

    /// The sandbox's classes in the shaper device's HTB (egress).
    fn shape_egress(
        &self,
        conn: &mut tc::Conn,
        bw: &crate::types::Bandwidth,
        ip: u32,
    ) -> Result<shaper::Tree, String> {
        let (Some(_), Some((name, dev))) = (&self.node.uplink, &self.node.shaper) else {
            return Err("the node has no uplink or no shaper device".into());
        };
        let tree = uplink_tree(ip, ip_be(self.node.host_ip)).ok_or(
            "the sandbox's index in the pool is 21,836 or more (egress limits need pools of up \
             to a /18)",
        )?;
        {
            // One root for every sandbox's tree: two first attaches at
            // once would both find none and race to make it.
            let _one = self.shaper_root.lock().unwrap_or_else(|p| p.into_inner());
            shaper::ensure_root(conn, *dev, name, 0).map_err(|e| e.to_string())?;
        }
        shaper::set_tree(conn, *dev, tree, bw.egress_bps, burst(bw.egress_burst))
            .map_err(|e| e.to_string())?;
        Ok(tree)
    }

    /// After a converge: removes the shapers of limits the sandbox no
    /// longer has (`before`: its `sb_rate` entry before the attach).
    fn unshape_leftovers(&self, sb: &SandboxPath<'_>, now: &Shape, before: Option<DpRate>) {
        let Some(before) = before else {
            return;
        };
        let Ok(mut conn) = tc::Conn::new() else {
            return;
        };
        if before.out_small != 0
            && now.egress.is_none()
            && let Some((_, uplink)) = &self.node.shaper
        {
            let tree = shaper::Tree {
                parent: before.out_small - 1,
                small: before.out_small,
                bulk: before.out_bulk,
            };
            if let Err(e) = shaper::remove_tree(&mut conn, *uplink, tree) {
                warn!(sandbox_id = sb.sandbox_id, error = %e, "removing the sandbox's uplink shaper classes");
            }
        }
        if before.in_shaped != 0
            && !now.ingress
            && let Err(e) = shaper::remove_root(&mut conn, sb.tap_ifindex)
        {
            warn!(sandbox_id = sb.sandbox_id, error = %e, "removing the shaper of the sandbox's device");
        }
    }

    pub(super) fn remove_sandbox(&self, sb: &SandboxPath<'_>) -> Result<(), DatapathError> {
        let IpAddr::V4(v4) = sb.sandbox_ip else {
            return Ok(());
        };
        let ip = ip_be(v4);
        let mut guard = self.lock();
        let inner = &mut *guard;
        let _ = inner.maps.sandboxes.remove(&sb.tap_ifindex);
        let before = inner.maps.sb_rate.get(&sb.tap_ifindex, 0).ok();
        let _ = inner.maps.sb_rate.remove(&sb.tap_ifindex);
        if inner
            .maps
            .by_ip
            .get(&ip, 0)
            .is_ok_and(|t| t.ifindex == sb.tap_ifindex)
        {
            let _ = inner.maps.by_ip.remove(&ip);
        }
        inner.policy4.remove(ip);
        inner.policy6.remove(ip);
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
        drop(guard);
        self.shaper_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&sb.tap_ifindex);
        // The device's own shaper goes with the device.
        let none = Shape {
            ingress: true,
            ..Shape::default()
        };
        self.unshape_leftovers(sb, &none, before);
        debug!(sandbox_id = sb.sandbox_id, "datapath entries removed");
        Ok(())
    }

    /// Writes the sandbox's entries, journalling each change (see `attach`).
    fn write_entries(
        inner: &mut Inner,
        journal: &mut Vec<Undo>,
        (ip, ifindex): (u32, u32),
        sb: &SandboxPath<'_>,
        shape: &Shape,
        (want4, want6): (&Wanted<DpPolicyData>, &Wanted<DpPolicy6Data>),
        want_ports: &[(DpPortmapKey, DpPortmapVal)],
    ) -> Result<(), DatapathError> {
        // The rules before the flags that make the programs read them (a
        // new sandbox is never judged without its keys). Only the keys
        // this sandbox does not have yet are written.
        inner
            .policy4
            .write(ip, (&want4.0, &want4.1), journal, Undo::Policy)?;
        inner
            .policy6
            .write(ip, (&want6.0, &want6.1), journal, Undo::Policy6)?;
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
        if sb.egress_rules {
            flags |= DP_F_RULES;
        }
        if shape.egress.is_some() {
            flags |= DP_F_SHAPE_OUT;
        }
        if sb.ipv6_egress() {
            flags |= DP_F_V6_OUT;
        }
        if !(want6.0.is_empty() && want6.1.is_empty()) {
            flags |= DP_F_V6_RULES;
        }
        let prev = maps.sb_rate.get(&ifindex, 0).ok();
        let rate = shape.rate();
        if rate.is_some() || prev.is_some() {
            journal.push(Undo::Rate(ifindex, prev));
            let r = match rate {
                Some(r) => maps.sb_rate.insert(ifindex, r, 0),
                None => maps.sb_rate.remove(&ifindex),
            };
            r.map_err(|e| map_err("writing the sb_rate map", &e))?;
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
        // Its IPv6 frames (per CPU; the datapath only adds to an entry).
        static CPUS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        if let Some(n) = *CPUS.get_or_init(|| aya::util::nr_cpus().ok())
            && let Ok(zero) = aya::maps::PerCpuValues::try_from(vec![DpTraffic6::default(); n])
        {
            let _ = maps.sb_traffic6.insert(ifindex, zero, BPF_NOEXIST);
        }
        let _ = maps
            .sb_share
            .insert(ifindex, DpShare::default(), BPF_NOEXIST);
        let mut tap = DpTap {
            ifindex,
            flags: if shape.ingress { DP_T_SHAPE_IN } else { 0 },
            generation,
        };
        if sb.paused {
            tap.flags |= DP_T_PAUSED;
        }
        let prev = maps.by_ip.get(&ip, 0).ok();
        // A pause starts (or ends): the device's last report goes, so the
        // first packet of this pause is reported (a restart re-attaching
        // a paused sandbox keeps the report: at most one per pause).
        let was_paused = prev.is_some_and(|p| p.ifindex == ifindex && p.flags & DP_T_PAUSED != 0);
        let rearm = was_paused != sb.paused;
        if rearm && sb.paused {
            let _ = maps.wake_sent.remove(&ifindex);
        }
        if prev != Some(tap) {
            journal.push(Undo::ByIp(ip, prev));
            maps.by_ip
                .insert(ip, tap, 0)
                .map_err(|e| map_err("writing the by_ip map", &e))?;
        }
        if rearm && !sb.paused {
            let _ = maps.wake_sent.remove(&ifindex);
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
                Undo::Rate(k, Some(v)) => maps.sb_rate.insert(k, v, 0),
                Undo::Rate(k, None) => maps.sb_rate.remove(&k),
                Undo::Policy(a) => inner.policy4.roll_back(a),
                Undo::Policy6(a) => inner.policy6.roll_back(a),
                Undo::Portmap(k, Some(v)) => maps.portmap.insert(k, v, 0),
                Undo::Portmap(k, None) => maps.portmap.remove(&k),
            };
            if let Err(e) = r {
                warn!(error = %crate::error_chain(&e), "rolling back a datapath entry failed");
            }
        }
    }
}
