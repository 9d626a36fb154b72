//! Health: every check with its verdict and a detail an operator can act
//! on, computed from live state (a released network leaves no trace) and,
//! for the datapath's filters, from the kernel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Agent, Uplink};
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
const FD_OVERHEAD: u64 = 1024;

impl Agent {
    /// Whether a full pool fits the agent's descriptors: one TAP fd per
    /// network plus the warm pool (kept up to twice its size) against
    /// RLIMIT_NOFILE, and the same TAP fds against the service manager's
    /// fd store when it says its size ($FDSTORE, systemd 254+). A node
    /// that runs out of either fails EnsureNetwork (EMFILE) or loses TAP
    /// fds at a restart.
    fn fd_limit_check(&self, pool_capacity: u32) -> Check {
        // TAPs, and the resolver's and proxy's sockets.
        let taps = u64::from(pool_capacity)
            + 2 * u64::from(self.cfg.warm_pool)
            + crate::systemd::SOCKET_FD_NAMES.len() as u64;
        let need = taps + FD_OVERHEAD;
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into a live struct.
        let nofile = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            lim.rlim_cur
        } else {
            u64::MAX
        };
        let fdstore: Option<u64> = std::env::var("FDSTORE").ok().and_then(|v| v.parse().ok());
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
                 resolver's and proxy's sockets): raise \
                 FileDescriptorStoreMax="
            ));
        }
        (
            "fd_limits".into(),
            problems.is_empty(),
            if problems.is_empty() {
                format!(
                    "a full pool needs {need} descriptors; RLIMIT_NOFILE {nofile}{}",
                    fdstore.map_or(String::new(), |m| format!(", fd store {m}"))
                )
            } else {
                problems.join("; ")
            },
        )
    }

    /// Whether the state directory takes writes: every EnsureNetwork and
    /// ReleaseNetwork needs one. False from the first failed write (ENOSPC,
    /// EIO, a failed fsync) until one succeeds again; the store retries by
    /// itself every second.
    fn store_check(&self) -> Check {
        let dir = self.cfg.state_dir.display();
        match self.store.failure() {
            None => {
                let st = self.store.stats();
                (
                    "store".into(),
                    true,
                    format!(
                        "{dir}: {} records, {} commits for {} writes",
                        self.active_networks(),
                        st.commits,
                        st.ops
                    ),
                )
            }
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
                mtu,
                ..
            } if *mtu < self.cfg.mtu => (
                "uplink".into(),
                false,
                format!(
                    "{name} {a}: its MTU {mtu} is below the sandboxes' default MTU {}: \
                     their full-size packets cannot leave the node (set mtu <= {mtu})",
                    self.cfg.mtu
                ),
            ),
            Uplink::Found {
                name,
                addr: Some(a),
                mtu,
                ..
            } => ("uplink".into(), true, format!("{name} {a}, MTU {mtu}")),
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
        checks.push((
            "tap_pool".into(),
            ps.quarantined.is_empty() && !starved,
            detail,
        ));
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
        checks.push(self.fd_limit_check(cap));
        checks.push(self.link_check());
        checks.push(self.tap_fd_check());
        checks.push(self.veth_check());
        checks.push(self.resolver_check());
        checks.push(self.proxy_check());
        let dp = self.datapath.clone();
        checks.extend(super::off_worker(move || dp.checks()).await);
        checks.extend(filters);
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
        let checks = self.filter_check().await;
        *last = Some((Instant::now(), checks.clone()));
        checks
    }

    /// Sandbox TAPs and veths someone else deleted, renamed, moved or set
    /// down, as the kernel announced it (see `note_link`): false until
    /// Reconcile repairs them (a veth cannot be made again: Reconcile
    /// records it gone and the `veths` check lists it).
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
        if live.is_empty() {
            (
                "sandbox_links".into(),
                true,
                format!(
                    "every TAP and veth of the {} networks is present, up and named as recorded",
                    views.len()
                ),
            )
        } else {
            (
                "sandbox_links".into(),
                false,
                format!(
                    "{}; ReconcileNetwork repairs them (\"\" for all)",
                    live.join("; ")
                ),
            )
        }
    }

    /// TAPs of live networks the agent holds no fd for (adopted after a
    /// restart without the fd store while a VMM held them). Not a fault:
    /// the VMM keeps forwarding; only OpenTap waits until it lets go, and
    /// OpenTap or Reconcile then take the TAP back. Computed from the live
    /// views, so a released network leaves no trace.
    pub(super) fn tap_fd_check(&self) -> Check {
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        let taps = views.values().filter(|v| v.record.attach.is_tap());
        let total = taps.clone().count();
        let held: Vec<&str> = taps
            .filter(|v| !v.tap_fd_held)
            .map(|v| v.record.sandbox_id.as_str())
            .collect();
        let detail = if held.is_empty() {
            format!("the agent holds the TAP fd of all {total} TAP networks")
        } else {
            format!(
                "{} of {} TAPs held only by another process since a restart without the fd store \
                 (OpenTap answers TapBusy until it closes them): {}",
                held.len(),
                total,
                held.join(", ")
            )
        };
        ("tap_fds".into(), true, detail)
    }

    /// CNI attachments whose veth went away with their container's
    /// namespace: not a fault of the node (the runtime's DEL, or GC,
    /// releases them), listed so an operator sees them.
    pub(super) fn veth_check(&self) -> Check {
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        let veths = views.values().filter(|v| !v.record.attach.is_tap());
        let total = veths.clone().count();
        let gone: Vec<&str> = veths
            .filter(|v| v.tap_ifindex == 0)
            .map(|v| v.record.sandbox_id.as_str())
            .collect();
        let detail = if gone.is_empty() {
            format!("{total} veth (CNI) networks, all with their veth")
        } else {
            format!(
                "{} of {total} veth (CNI) networks lost their veth with their container's \
                 namespace and wait for ReleaseNetwork (CNI DEL or GC): {}",
                gone.len(),
                gone.join(", ")
            )
        };
        ("veths".into(), true, detail)
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
        let detail = if missing.is_empty() {
            format!(
                "the kernel has every datapath hook ({node_count} node hooks, from_guest for {total_taps} sandboxes)"
            )
        } else {
            format!(
                "missing in the kernel: {}; ReconcileNetwork \"\" attaches them again",
                missing.join("; ")
            )
        };
        let mut checks = vec![("datapath_filters".into(), missing.is_empty(), detail)];
        let tags = self.datapath.program_tags();
        if !tags.is_empty() {
            let (bound, own) = self.datapath.tap_counts();
            other_build.extend(self.datapath.stale());
            let mut detail = format!(
                "this build's programs: {}; from_guest runs on {bound} TAPs and veths bound to the shared tc block{}",
                tags.iter()
                    .map(|(p, t)| format!("{p} {t:016x}"))
                    .collect::<Vec<_>>()
                    .join(", "),
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
            checks.push(("datapath_programs".into(), other_build.is_empty(), detail));
        }
        checks
    }
}
