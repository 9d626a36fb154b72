//! Health: every check with its verdict and a detail an operator can act
//! on, computed from live state (a released network leaves no trace) and,
//! for the datapath's filters, from the kernel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Agent;
use crate::datapath::Check;

/// How old Health's kernel part (the datapath hooks, a few tc requests)
/// may be when it is read; anything that may change it (a tc removal the
/// kernel announced, Reconcile) makes the next read recompute it. Reads of
/// `Healthy` and Health by anyone allowed to read cost no kernel walk.
pub const KERNEL_MAX_AGE: Duration = Duration::from_secs(2);

/// Health's kernel part, cached.
#[derive(Default)]
pub struct KernelChecks {
    dirty: AtomicBool,
    last: tokio::sync::Mutex<Option<(Instant, Vec<Check>)>>,
}

impl KernelChecks {
    /// The next read asks the kernel again.
    pub fn invalidate(&self) {
        self.dirty.store(true, Ordering::Release);
    }
}

/// Descriptors the agent needs besides one per TAP: buses, varlink
/// connections, netlink and bpf maps, the store, journald.
pub(super) const FD_OVERHEAD: u64 = 1024;

/// RLIMIT_NOFILE (soft; the agent raises it to the hard limit at start).
pub(super) fn nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        u64::MAX
    }
}

impl Agent {
    /// Whether a full pool fits the agent's descriptors: one TAP fd per
    /// network plus the warm pool (kept up to twice its size) against
    /// RLIMIT_NOFILE, and the same TAP fds against the service manager's
    /// fd store when it says its size ($FDSTORE, systemd 254+). A node
    /// that runs out of either fails EnsureNetwork (EMFILE) or loses TAP
    /// fds at a restart.
    fn fd_limit_check(&self, pool_capacity: u32) -> Check {
        let taps = self.tap_fds_needed(pool_capacity);
        let nofile = nofile();
        let fdstore: Option<u64> = std::env::var("FDSTORE").ok().and_then(|v| v.parse().ok());
        verdict::fd_limits(nofile, fdstore, taps)
    }

    /// TAP fds a full pool holds (and the resolver's and proxy's listening
    /// sockets).
    pub(super) fn tap_fds_needed(&self, pool_capacity: u32) -> u64 {
        u64::from(pool_capacity)
            + 2 * u64::from(self.cfg.warm_pool)
            + crate::systemd::SOCKET_FD_NAMES.len() as u64
    }

    /// How many slots the resolver and the proxy get: what RLIMIT_NOFILE
    /// leaves after a full pool of TAPs and the agent's own descriptors.
    pub fn socket_caps(&self) -> crate::policy::Caps {
        let need = self.tap_fds_needed(self.allocs().ips.capacity()) + FD_OVERHEAD;
        crate::policy::Caps::for_spare(nofile().saturating_sub(need))
    }

    /// Whether the state directory takes writes: every EnsureNetwork and
    /// ReleaseNetwork needs one. False from the first failed write (ENOSPC,
    /// EIO, a failed fsync) until one succeeds again; the store retries by
    /// itself every second.
    fn store_check(&self) -> Check {
        verdict::store(
            &self.cfg.state_dir.display().to_string(),
            self.store.failure().as_ref(),
            self.active_networks(),
            &self.store.stats(),
        )
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
        let filters = self.kernel_checks().await;
        let mut checks: Vec<Check> = vec![];
        checks.push(self.store_check());
        checks.push(verdict::uplink(
            &self.uplink,
            self.ipv6_link().then(|| self.uplink6()),
            self.cfg.mtu,
        ));
        let (free, cap) = {
            let a = self.allocs();
            (a.ips.free(), a.ips.capacity())
        };
        checks.push(verdict::addresses(free, cap, &self.d.pool.to_string()));
        checks.push(verdict::tap_pool(&self.pool.stats()));
        checks.push(verdict::recovery(&self.recovery));
        checks.push(self.fd_limit_check(cap));
        checks.push(self.link_check());
        checks.push(self.resolver_check());
        checks.push(self.proxy_check());
        let dp = self.datapath.clone();
        checks.extend(super::off_worker(move || dp.checks()).await);
        checks.extend(filters);
        debug_assert!(
            checks.iter().all(|c| CHECKS.contains(&c.0.as_str())),
            "a check missing from CHECKS: {checks:?}"
        );
        (checks.iter().all(|c| c.1), checks)
    }

    /// Health's kernel part: cached (see [`KERNEL_MAX_AGE`]); concurrent
    /// readers share one computation.
    async fn kernel_checks(&self) -> Vec<Check> {
        let k = &self.kernel_checks;
        let mut last = k.last.lock().await;
        let dirty = k.dirty.swap(false, Ordering::AcqRel);
        if !dirty
            && let Some((at, checks)) = last.as_ref()
            && at.elapsed() < KERNEL_MAX_AGE
        {
            return checks.clone();
        }
        let mut checks = self.filter_check().await;
        checks.insert(0, self.gateway_check().await);
        *last = Some((Instant::now(), checks.clone()));
        checks
    }

    /// Sandbox TAPs and veths someone else deleted, renamed, moved or set
    /// down, as the kernel announced it (see `note_link`): false until
    /// Reconcile repairs them (a veth cannot be made again: Reconcile
    /// records it gone). The detail also lists what is no fault: TAPs of
    /// live networks the agent holds no fd for (adopted after a restart
    /// without the fd store while a VMM held them: OpenTap waits until it
    /// lets go), and CNI networks whose veth went with their container's
    /// namespace (the runtime's DEL, or GC, releases them, or the agent
    /// once it finds the namespace gone). Computed from
    /// the live views, so a released network leaves no trace.
    pub(super) fn link_check(&self) -> Check {
        // A copy, so no two of these locks are ever held at once (the
        // writers take them one after the other).
        let faults = self
            .link_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        let live: Vec<String> = faults
            .iter()
            .filter(|(ifindex, (id, _))| views.get(id).is_some_and(|v| v.tap_ifindex == **ifindex))
            .map(|(_, (id, why))| format!("{id}: {why}"))
            .collect();
        let mut devices = verdict::Devices {
            networks: views.len(),
            ..Default::default()
        };
        for v in views.values() {
            if v.record.by_name() {
                // Handed over by name: the agent never holds its fd.
                devices.by_name += 1;
            } else if v.record.attach.is_tap() {
                devices.taps += 1;
                if !v.tap_fd_held {
                    devices.held_elsewhere.push(v.record.sandbox_id.clone());
                }
            } else {
                devices.veths += 1;
                if v.tap_ifindex == 0 {
                    devices.veths_gone.push(v.record.sandbox_id.clone());
                }
            }
        }
        verdict::sandbox_links(&live, &devices)
    }

    /// What is wrong with the gateway device as the kernel has it (gone,
    /// renamed, down, without the pool's gateway address, the route to the
    /// pool without the sandboxes' MTU); empty when nothing is.
    pub(super) async fn gateway_problems(&self) -> Vec<String> {
        let (ifindex, name) = (self.gateway.ifindex, &self.cfg.gateway_device);
        let mut problems = vec![];
        match self.nl.link_by_index(ifindex).await {
            Ok(Some(l)) => {
                if &l.name != name {
                    problems.push(format!("renamed to {}", l.name));
                }
                if !l.up {
                    problems.push("down".to_owned());
                }
            }
            Ok(None) => problems.push("gone (the datapath needs it: restart the agent)".to_owned()),
            Err(e) => problems.push(format!("cannot look it up: {e}")),
        }
        if !problems.is_empty() {
            return problems;
        }
        let (gw, len) = (self.d.pool.gateway(), self.d.pool.prefix_len());
        match self.nl.ipv4_addrs(ifindex).await {
            Ok(a) if a.contains(&(gw, len)) => {}
            Ok(_) => problems.push(format!("without its address {gw}/{len}")),
            Err(e) => problems.push(format!("cannot list its addresses: {e}")),
        }
        match self.nl.route_mtu(self.d.pool.network(), len, ifindex).await {
            Ok(Some(m)) if m == self.cfg.mtu => {}
            Ok(m) => problems.push(format!(
                "the route to {} has MTU {} instead of the sandboxes' {}: the host's packets \
                 to sandboxes may not fit their links",
                self.d.pool,
                m.map_or("none".to_owned(), |m| m.to_string()),
                self.cfg.mtu
            )),
            Err(e) => problems.push(format!("cannot read the route to the pool: {e}")),
        }
        // Host <-> sandbox over IPv6 (`pool6_setup`): the address, the
        // route and the neighbour it goes via.
        if self.gateway.pool6 {
            let host6 = self.d.pool6_addr(gw);
            let net6 = self.d.pool6_addr(std::net::Ipv4Addr::UNSPECIFIED);
            let via = crate::types::link_local(&self.d.gateway_mac);
            match self.nl.ipv6_addrs(ifindex).await {
                Ok(a) if a.contains(&host6) => {}
                Ok(_) => problems.push(format!("without its IPv6 address {host6}")),
                Err(e) => problems.push(format!("cannot list its IPv6 addresses: {e}")),
            }
            match self.nl.ipv6_route((net6, 96), ifindex).await {
                Ok(true) => {}
                Ok(false) => problems.push(format!(
                    "no route to {net6}/96 (ipv6_pool): the host cannot reach sandboxes over IPv6"
                )),
                Err(e) => problems.push(format!("cannot read the route to ipv6_pool: {e}")),
            }
            match self.nl.ipv6_neighbour_permanent(ifindex, via).await {
                Ok(true) => {}
                Ok(false) => problems.push(format!(
                    "no permanent neighbour {via} (the route to ipv6_pool goes via it)"
                )),
                Err(e) => problems.push(format!("cannot list its IPv6 neighbours: {e}")),
            }
        }
        problems
    }

    async fn gateway_check(&self) -> Check {
        let mut what = format!(
            "{} ({}) ifindex {} holds {}/{}, route MTU {}",
            self.cfg.gateway_device,
            self.gateway.kind,
            self.gateway.ifindex,
            self.d.pool.gateway(),
            self.d.pool.prefix_len(),
            self.cfg.mtu
        );
        if self.gateway.pool6 {
            what += &format!(
                ", {} and the route to {}/96",
                self.d.pool6_addr(self.d.pool.gateway()),
                self.d.pool6_addr(std::net::Ipv4Addr::UNSPECIFIED)
            );
        }
        verdict::gateway_device(&what, &self.gateway_problems().await)
    }

    /// The datapath's hooks as the kernel has them: the node hooks (the
    /// shared block's filter, the anchor's binding, the node devices'
    /// filters: a few requests) every time, with their program tags; TAPs
    /// only where the kernel announced a qdisc or filter removal (none in
    /// the normal case). What is missing is reported until Reconcile (or a
    /// restart) attaches it again.
    pub(super) async fn filter_check(&self) -> Vec<Check> {
        let node_hooks = self.datapath.node_hooks();
        if node_hooks.is_empty() {
            return vec![];
        }
        let node_count = node_hooks.len();
        let drifted: BTreeMap<u32, String> =
            self.drift.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (hooks, owners, total_taps) = {
            let views = self.views.read().unwrap_or_else(|p| p.into_inner());
            let mut hooks = node_hooks;
            let mut owners: HashMap<u32, String> = HashMap::new();
            if !drifted.is_empty() {
                for v in views
                    .values()
                    .filter(|v| v.tap_ifindex != 0 && drifted.contains_key(&v.tap_ifindex))
                {
                    hooks.extend(self.datapath.tap_hook(&v.record.tap_name, v.tap_ifindex));
                    owners.insert(v.tap_ifindex, v.record.sandbox_id.clone());
                }
            }
            (hooks, owners, views.len())
        };
        let dp = self.datapath.clone();
        let wanted = hooks.clone();
        // Not `off_worker`: a Health call in flight when the agent stops
        // answers "cannot check" instead of panicking the worker.
        let checked = match tokio::task::spawn_blocking(move || dp.check(&wanted)).await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(crate::datapath::DatapathError {
                what: "checking the datapath hooks",
                detail: e.to_string(),
                fatal: false,
            }),
        };
        let (mut missing, mut other_build) = (vec![], vec![]);
        let mut bad: HashSet<u32> = HashSet::new();
        match checked {
            Ok(drift) => {
                for (i, why) in drift {
                    let hook = &hooks[i];
                    bad.insert(hook.ifindex);
                    let line = format!(
                        "{hook}{}: {why}{}",
                        owners
                            .get(&hook.ifindex)
                            .map(|id| format!(" of {id}"))
                            .unwrap_or_default(),
                        drifted
                            .get(&hook.ifindex)
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default(),
                    );
                    if why.contains("not this build's") {
                        other_build.push(line);
                    } else {
                        missing.push(line);
                    }
                }
            }
            Err(e) => missing.push(format!("cannot check: {e}")),
        }
        // Drifted devices that are fine again, or neither node devices nor
        // live TAPs (a pool TAP, a deleted device): nothing to report.
        self.drift
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|i, _| !drifted.contains_key(i) || bad.contains(i));
        let mut checks = vec![verdict::filters(&missing, node_count, total_taps)];
        let tags = self.datapath.program_tags();
        if !tags.is_empty() {
            let (bound, own) = self.datapath.tap_counts();
            other_build.extend(self.datapath.stale());
            let tags = tags
                .iter()
                .map(|(p, t)| format!("{p} {t:016x}"))
                .collect::<Vec<_>>()
                .join(", ");
            checks.push(verdict::programs(&tags, bound, own, &other_build));
        }
        checks
    }
}

/// Every check Health reports (and so the metrics and CNI STATUS), in
/// order. Each has a verdict function of its inputs below (or in the
/// datapath); `every_check_can_fail` proves each can turn false.
pub const CHECKS: &[&str] = &[
    "store",
    "uplink",
    "addresses",
    "tap_pool",
    "recovery",
    "fd_limits",
    "sandbox_links",
    "dns_resolver",
    "egress_proxy",
    "datapath",
    "flow_table",
    "datapath_pins",
    "datapath_loopback",
    "datapath_uplink",
    "bandwidth",
    "gateway_device",
    "datapath_filters",
    "datapath_programs",
];

/// "1 sandbox", "2 sandboxes".
pub fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The checks' verdicts as functions of what they look at: no check is a
/// constant.
pub mod verdict {
    use super::super::{RecoveryReport, Uplink};
    use super::FD_OVERHEAD;
    use super::count;
    use crate::agent::pool::PoolStats;
    use crate::datapath::Check;
    use crate::store::{StoreFailure, StoreStats};

    pub fn store(
        dir: &str,
        failure: Option<&StoreFailure>,
        records: u32,
        st: &StoreStats,
    ) -> Check {
        match failure {
            None => (
                "store".into(),
                true,
                format!(
                    "{dir}: {records} records, {} commits for {} writes",
                    st.commits, st.ops
                ),
            ),
            Some(f) => (
                "store".into(),
                false,
                format!(
                    "{dir}: {} failed{}: {}, for {} s; EnsureNetwork and ReleaseNetwork fail until \
                     a write succeeds (retried every second{})",
                    f.what,
                    f.errno
                        .map(|e| format!(" with {:?}", nix::errno::Errno::from_raw(e)))
                        .unwrap_or_default(),
                    f.error,
                    f.since.elapsed().map_or(0, |d| d.as_secs()),
                    if f.poisoned {
                        "; after a failed fsync the committed state is rewritten from memory"
                    } else {
                        ""
                    }
                ),
            ),
        }
    }

    /// `addr6`: with the guests' IPv6 link, the uplink's NAT66 address
    /// (`None` inside: the node has no IPv6 egress, said in the detail).
    pub fn uplink(
        u: &Uplink,
        addr6: Option<Option<std::net::Ipv6Addr>>,
        default_mtu: u32,
    ) -> Check {
        match u {
            Uplink::Found {
                name,
                addr: Some(a),
                mtu,
                ..
            } if *mtu < default_mtu => (
                "uplink".into(),
                false,
                format!(
                    "{name} {a}: its MTU {mtu} is below the sandboxes' default MTU {default_mtu}: \
                     their full-size packets cannot leave the node (set mtu <= {mtu})"
                ),
            ),
            Uplink::Found {
                name,
                addr: Some(a),
                mtu,
                ..
            } => (
                "uplink".into(),
                true,
                match addr6 {
                    Some(Some(a6)) => format!("{name} {a} {a6}, MTU {mtu}"),
                    Some(None) => format!(
                        "{name} {a}, MTU {mtu}; no IPv6 egress: {name} has no usable global \
                         IPv6 address with an IPv6 default route (sandboxes are IPv4-only)"
                    ),
                    None => format!("{name} {a}, MTU {mtu}"),
                },
            ),
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
        }
    }

    pub fn addresses(free: u32, cap: u32, pool: &str) -> Check {
        (
            "addresses".into(),
            free > 0,
            format!("{free} of {cap} free in {pool}"),
        )
    }

    pub fn tap_pool(ps: &PoolStats) -> Check {
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
        // Empty is fine while refills work (a burst took every idle TAP:
        // creates are cold for a moment); empty because creation fails is
        // not.
        let starved = ps.target > 0 && ps.idle == 0 && ps.refill_error.is_some();
        if starved {
            detail.push_str(&format!(
                "; empty and cannot refill: {}",
                ps.refill_error.as_deref().unwrap_or_default()
            ));
        }
        (
            "tap_pool".into(),
            ps.quarantined.is_empty() && !starved,
            detail,
        )
    }

    pub fn recovery(r: &RecoveryReport) -> Check {
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
        (
            "recovery".into(),
            r.quarantined.is_empty() && r.store_problems.is_empty() && r.errors.is_empty(),
            detail,
        )
    }

    /// `taps`: the TAP fds a full pool holds; `fdstore`: the service
    /// manager's fd store size, when it says it.
    pub fn fd_limits(nofile: u64, fdstore: Option<u64>, taps: u64) -> Check {
        let need = taps + FD_OVERHEAD;
        let mut problems = vec![];
        if nofile < need {
            problems.push(format!(
                "RLIMIT_NOFILE {nofile} is below the {need} descriptors a full pool needs \
                 ({taps} TAPs + {FD_OVERHEAD}): raise LimitNOFILE="
            ));
        }
        if let Some(max) = fdstore.filter(|m| *m > 0 && *m < taps) {
            problems.push(format!(
                "the fd store holds {max}, a full pool parks {taps} fds (TAPs and the \
                 resolver's and proxy's sockets): raise FileDescriptorStoreMax="
            ));
        }
        let caps = crate::policy::Caps::for_spare(nofile.saturating_sub(need));
        (
            "fd_limits".into(),
            problems.is_empty(),
            if problems.is_empty() {
                format!(
                    "a full pool needs {need} descriptors; RLIMIT_NOFILE {nofile}{}; the rest \
                     sizes the resolver ({} UDP queries, {} TCP connections at once) and the \
                     proxy ({} connections)",
                    fdstore.map_or(String::new(), |m| format!(", fd store {m}")),
                    caps.udp,
                    caps.tcp,
                    caps.proxy
                )
            } else {
                problems.join("; ")
            },
        )
    }

    /// The sandbox devices: how many, and what is worth knowing but no
    /// fault.
    #[derive(Debug, Default)]
    pub struct Devices {
        pub networks: usize,
        pub taps: usize,
        /// TAP networks whose TAP only another process holds (no fd of
        /// the agent's since a restart without the fd store).
        pub held_elsewhere: Vec<String>,
        /// TAP networks handed over by name (no agent fd by design).
        pub by_name: usize,
        pub veths: usize,
        /// CNI networks whose veth went with their container's namespace.
        pub veths_gone: Vec<String>,
    }

    /// `faults`: devices someone else changed ("id: what happened").
    pub fn sandbox_links(faults: &[String], d: &Devices) -> Check {
        let mut detail = if faults.is_empty() {
            format!(
                "every TAP and veth of {} is present, up and named as recorded",
                count(d.networks, "network", "networks")
            )
        } else {
            format!(
                "{}; ReconcileNetwork repairs them (\"\" for all)",
                faults.join("; ")
            )
        };
        if d.held_elsewhere.is_empty() {
            detail.push_str(&format!(
                "; the agent holds the TAP fd of every TAP network ({})",
                d.taps
            ));
        } else {
            detail.push_str(&format!(
                "; {} of {} TAPs held only by another process since a restart without the fd \
                 store (no fault; OpenTap answers TapBusy until it closes them): {}",
                d.held_elsewhere.len(),
                d.taps,
                d.held_elsewhere.join(", ")
            ));
        }
        if d.by_name > 0 {
            detail.push_str(&format!(
                "; {} TAPs handed over by name (the agent holds no fd of them)",
                d.by_name
            ));
        }
        if d.veths_gone.is_empty() {
            detail.push_str(&format!(
                "; {} veth (CNI) networks, all with their veth",
                d.veths
            ));
        } else {
            detail.push_str(&format!(
                "; {} of {} veth (CNI) networks lost their veth with their container's \
                 namespace and wait for their release (CNI DEL or GC, or the agent's own once the \
                 namespace is gone; no fault): {}",
                d.veths_gone.len(),
                d.veths,
                d.veths_gone.join(", ")
            ));
        }
        ("sandbox_links".into(), faults.is_empty(), detail)
    }

    /// `missing`: hooks the kernel lacks.
    pub fn filters(missing: &[String], node_hooks: usize, taps: usize) -> Check {
        let detail = if missing.is_empty() {
            format!(
                "the kernel has every datapath hook ({node_hooks} node hooks, from_guest for {})",
                count(taps, "sandbox", "sandboxes")
            )
        } else {
            format!(
                "missing in the kernel: {}; ReconcileNetwork \"\" attaches them again",
                missing.join("; ")
            )
        };
        ("datapath_filters".into(), missing.is_empty(), detail)
    }

    /// `other_build`: hooks that run another build's program.
    pub fn programs(tags: &str, bound: usize, own: usize, other_build: &[String]) -> Check {
        let mut detail = format!(
            "this build's programs: {tags}; from_guest runs on {bound} TAPs and veths bound to the shared tc block{}",
            if own > 0 {
                format!(
                    " and on {own} with an older build's own filter (this build's program in place until they are recycled)"
                )
            } else {
                String::new()
            }
        );
        if !other_build.is_empty() {
            detail.push_str(&format!(
                "; running another build's program: {}",
                other_build.join("; ")
            ));
        }
        ("datapath_programs".into(), other_build.is_empty(), detail)
    }

    /// The gateway device as the kernel has it: present, up, holding the
    /// pool's gateway address, and the route to the pool with the
    /// sandboxes' MTU. `problems` lists what is not so.
    pub fn gateway_device(what: &str, problems: &[String]) -> Check {
        if problems.is_empty() {
            ("gateway_device".into(), true, what.to_owned())
        } else {
            (
                "gateway_device".into(),
                false,
                format!(
                    "{what}: {}; restart the agent (or ReconcileNetwork \"\") to put it back",
                    problems.join("; ")
                ),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{RecoveryReport, Uplink};
    use super::*;
    use crate::agent::pool::PoolStats;
    use crate::store::{StoreFailure, StoreStats};

    /// For every check Health reports, a case where it passes and one
    /// where it fails: a verdict that cannot turn false fails this test.
    #[test]
    fn every_check_can_fail() {
        let uplink = |mtu| Uplink::Found {
            name: "eth0".into(),
            ifindex: 2,
            addr: Some(std::net::Ipv4Addr::new(10, 0, 0, 2)),
            mtu,
        };
        let pool = |quarantined: Vec<(String, String)>| PoolStats {
            idle: 1,
            target: 16,
            abnormal: 0,
            quarantined,
            retiring: 0,
            created: 0,
            deleted: 0,
            last_error: None,
            refill_error: None,
        };
        let failure = StoreFailure {
            what: "journal fsync",
            errno: Some(libc::EIO),
            error: "EIO".into(),
            since: std::time::SystemTime::now(),
            poisoned: true,
        };
        let st = StoreStats {
            commits: 0,
            ops: 0,
            journal_bytes: 0,
            compactions: 0,
        };
        let bad_recovery = RecoveryReport {
            errors: vec!["x".into()],
            ..Default::default()
        };
        let devices = verdict::Devices::default();
        let status_ok = std::sync::Mutex::new(Some(Ok("listening".to_owned())));
        let status_err =
            std::sync::Mutex::new(Some(Err::<String, _>("binding: EADDRINUSE".into())));
        let dp = crate::datapath::ebpf::check_cases();
        let mut cases: Vec<(Check, Check)> = vec![
            (
                verdict::store("/s", None, 0, &st),
                verdict::store("/s", Some(&failure), 0, &st),
            ),
            (
                verdict::uplink(&uplink(1500), None, 1300),
                verdict::uplink(&uplink(1280), None, 1300),
            ),
            (verdict::addresses(1, 2, "p"), verdict::addresses(0, 2, "p")),
            (
                verdict::tap_pool(&pool(vec![])),
                verdict::tap_pool(&pool(vec![("t".into(), "why".into())])),
            ),
            (
                verdict::recovery(&RecoveryReport::default()),
                verdict::recovery(&bad_recovery),
            ),
            (
                verdict::fd_limits(100_000, None, 100),
                verdict::fd_limits(1000, None, 100),
            ),
            (
                verdict::sandbox_links(&[], &devices),
                verdict::sandbox_links(&["sbx: deleted".into()], &devices),
            ),
            (
                crate::agent::egress::resolver_verdict(&status_ok, 1, None, ""),
                crate::agent::egress::resolver_verdict(&status_err, 1, None, ""),
            ),
            (
                crate::agent::egress::proxy_verdict(&status_ok, 1, None, ""),
                crate::agent::egress::proxy_verdict(&status_ok, 1, Some("EPERM"), ""),
            ),
            (
                verdict::gateway_device("cube-dev", &[]),
                verdict::gateway_device("cube-dev", &["down".into()]),
            ),
            (
                verdict::filters(&[], 4, 1),
                verdict::filters(&["lo egress: no filter".into()], 4, 1),
            ),
            (
                verdict::programs("t", 1, 0, &[]),
                verdict::programs("t", 1, 0, &["ifindex 7: old".into()]),
            ),
        ];
        cases.extend(dp);
        for name in CHECKS {
            let Some((good, bad)) = cases.iter().find(|(g, _)| g.0 == *name) else {
                panic!("no case for the check {name}");
            };
            assert_eq!(bad.0, *name);
            assert!(good.1, "{name} passes on good input: {good:?}");
            assert!(!bad.1, "{name} fails on bad input: {bad:?}");
        }
        // And nothing Health reports is missing from CHECKS.
        for (good, _) in &cases {
            assert!(
                CHECKS.contains(&good.0.as_str()),
                "{} not in CHECKS",
                good.0
            );
        }
    }
}
