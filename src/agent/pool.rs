//! Warm pool of ready TAPs.
//!
//! Creating a TAP costs ~0.2 ms but deleting one costs ~20 ms of RCU wait,
//! so TAPs are recycled: released TAPs are reset (renamed to a pool name,
//! set down, MTU restored) and go back to the idle queue. A background task
//! keeps `target` TAPs idle, retries TAPs whose reset failed (the abnormal
//! queue) and quarantines them after [`MAX_RESET_ATTEMPTS`], and deletes
//! surplus or broken TAPs in batches: each is moved into the retire link
//! group and one RTM_DELLINK for the group removes them all within a single
//! RCU grace period. Deletion uses its own netlink socket so it never
//! delays a caller's netlink requests.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::spec::{TapNameKind, TapOwner, by_name_tap_name, classify_tap_name, pool_tap_name};
use crate::netlink::{LinkChange, Netlink};
use crate::tap::Tap;

pub const MAX_RESET_ATTEMPTS: u32 = 3;
/// The `ip link` alias of an idle pool TAP, written by the same
/// RTM_NEWLINK that creates or resets it for the pool. Recovery adopts
/// only TAPs that carry it: a TAP that was in use when the agent died, or
/// that an older version pooled after handing it out, is retired instead.
pub const IDLE_ALIAS: &str = "cube-network-agent: idle";
/// The alias of a TAP taken for a sandbox (set with its MTU and up).
pub const IN_USE_ALIAS: &str = "cube-network-agent: in use";
const RESET_BACKOFF: Duration = Duration::from_millis(200);
const IDLE_TICK: Duration = Duration::from_millis(500);
/// A deletion holds RTNL for an RCU grace period (~20 ms) whatever the batch
/// size, stalling every netlink request behind it: delete in batches of
/// this many, or once the oldest has waited `DELETE_AFTER`.
const DELETE_BATCH: usize = 32;
const DELETE_AFTER: Duration = Duration::from_secs(1);

/// A TAP with its interface index.
#[derive(Debug)]
pub struct PoolTap {
    pub tap: Tap,
    pub ifindex: u32,
}

/// What to do after a TAP failed to reset `attempts` times in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetVerdict {
    RetryAfter(Duration),
    Quarantine,
}

pub fn after_reset_failure(attempts: u32) -> ResetVerdict {
    if attempts >= MAX_RESET_ATTEMPTS {
        ResetVerdict::Quarantine
    } else {
        ResetVerdict::RetryAfter(RESET_BACKOFF * 2u32.saturating_pow(attempts.saturating_sub(1)))
    }
}

#[derive(Debug)]
struct Abnormal {
    tap: PoolTap,
    attempts: u32,
    error: String,
    next_try: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    idle: VecDeque<PoolTap>,
    /// TAPs to delete in the next batch (we hold their fd).
    /// With whether each is in the retire group already (moved by
    /// `discard` or a surplus `give_back`: the batch does not move it again).
    retiring: Vec<(PoolTap, bool)>,
    /// Links to delete that we hold no fd for (found at recovery).
    retiring_links: Vec<u32>,
    /// When the oldest TAP now waiting for deletion was first seen.
    retiring_since: Option<Instant>,
    abnormal: Vec<Abnormal>,
    /// (name, last error) of TAPs given up on.
    quarantined: Vec<(String, String)>,
    created: u64,
    deleted: u64,
    last_error: Option<String>,
    /// Set while refills fail (the last creation failed), cleared by the
    /// next TAP created.
    refill_error: Option<String>,
}

/// Counters for Health and properties.
#[derive(Debug, Clone, Default)]
pub struct PoolStats {
    pub idle: usize,
    pub target: usize,
    pub abnormal: usize,
    pub quarantined: Vec<(String, String)>,
    pub retiring: usize,
    pub created: u64,
    pub deleted: u64,
    pub last_error: Option<String>,
    /// Why the pool cannot refill, while it cannot.
    pub refill_error: Option<String>,
}

pub struct TapPool {
    nl: Netlink,
    /// Separate socket for slow deletions.
    nl_bg: Netlink,
    prefix: String,
    mtu: u32,
    target: usize,
    retire_group: u32,
    next_name: AtomicU32,
    inner: Mutex<Inner>,
    wake: Notify,
    datapath: std::sync::Arc<dyn crate::datapath::Datapath>,
    /// Idle-count changes are node events (the IdleTaps property).
    events: std::sync::Arc<super::events::Events>,
    /// Counters of TAPs handed over by name, loaded at first use.
    by_name: Mutex<Option<NameBlock>>,
}

/// The file in the state directory that keeps the by-name counter: the
/// first value no run has reserved yet.
pub const BY_NAME_FILE: &str = "tap-names";
/// Counters reserved per write of [`BY_NAME_FILE`].
const BY_NAME_BLOCK: u32 = 256;
/// 7 hex digits.
const BY_NAME_MAX: u32 = 0x0fff_ffff;

/// The by-name counters this run may hand out: `next..limit`, where
/// `limit` is already durable in [`BY_NAME_FILE`].
#[derive(Debug)]
struct NameBlock {
    next: u32,
    limit: u32,
}

/// The pool's settings, from the configuration.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// TAP name prefix.
    pub prefix: String,
    pub mtu: u32,
    /// Idle TAPs wanted.
    pub target: usize,
    /// Link group of TAPs waiting for batched deletion.
    pub retire_group: u32,
}

impl TapPool {
    pub fn new(
        nl: Netlink,
        nl_bg: Netlink,
        settings: PoolSettings,
        datapath: std::sync::Arc<dyn crate::datapath::Datapath>,
        events: std::sync::Arc<super::events::Events>,
    ) -> Self {
        let PoolSettings {
            prefix,
            mtu,
            target,
            retire_group,
        } = settings;
        Self {
            nl,
            nl_bg,
            prefix,
            mtu,
            target,
            retire_group,
            next_name: AtomicU32::new(0),
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            datapath,
            events,
            by_name: Mutex::new(None),
        }
    }

    /// A name for a TAP handed over by name that no TAP on this node ever
    /// had: the counter in `dir`/[`BY_NAME_FILE`] only grows, written
    /// (fsynced) a block ahead of the names handed out, so neither a crash
    /// nor a restart hands a name out twice. A VMM that remembers an old
    /// name finds nothing there (or, as root, makes a TAP nobody routes).
    /// Blocking (file I/O): call it off the async workers.
    pub fn fresh_by_name(&self, dir: &std::path::Path) -> std::io::Result<String> {
        let mut guard = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        let path = dir.join(BY_NAME_FILE);
        let block = match guard.as_mut() {
            Some(b) => b,
            None => {
                let stored = match std::fs::read_to_string(&path) {
                    Ok(s) => s.trim().parse::<u32>().map_err(|e| {
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("{}: {e}", path.display()),
                        )
                    })?,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                    Err(e) => return Err(e),
                };
                // Names in the kernel count too (a state directory
                // restored from an old copy).
                let seen = nix::net::if_::if_nameindex()
                    .map(|l| {
                        l.iter()
                            .filter_map(|i| {
                                match classify_tap_name(&self.prefix, &i.name().to_string_lossy()) {
                                    TapNameKind::ByName(n) => Some(n.saturating_add(1)),
                                    _ => None,
                                }
                            })
                            .max()
                            .unwrap_or(0)
                    })
                    .unwrap_or(0);
                let next = stored.max(seen);
                guard.insert(NameBlock { next, limit: next })
            }
        };
        if block.next >= BY_NAME_MAX {
            return Err(std::io::Error::other(
                "every name for TAPs handed over by name has been used on this node",
            ));
        }
        if block.next == block.limit {
            let limit = block.limit.saturating_add(BY_NAME_BLOCK).min(BY_NAME_MAX);
            write_durably(&path, format!("{limit}\n").as_bytes())?;
            block.limit = limit;
        }
        let n = block.next;
        block.next += 1;
        Ok(by_name_tap_name(&self.prefix, n))
    }

    /// The idle count (or the pool's health) changed.
    fn changed(&self) {
        self.events.publish(super::events::Change::Node);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh pool name (idle TAPs keep theirs for life: taking one for a
    /// sandbox and giving it back renames nothing).
    pub fn next_pool_name(&self) -> String {
        pool_tap_name(&self.prefix, self.next_name.fetch_add(1, Ordering::Relaxed))
    }

    /// Pool names continue after the highest one seen at recovery.
    pub fn continue_names_after(&self, n: u32) {
        self.next_name
            .fetch_max(n.wrapping_add(1), Ordering::Relaxed);
    }

    /// An idle TAP, if any (the refill task is woken to replace it).
    pub fn take(&self) -> Option<PoolTap> {
        let tap = self.lock().idle.pop_front();
        self.wake.notify_one();
        if tap.is_some() {
            self.changed();
        }
        tap
    }

    /// Idle TAPs kept before released ones are retired: twice the target,
    /// so a steady stream of ensure/release pairs recycles TAPs instead of
    /// creating one (refill) and deleting one (release) per pair.
    fn keep_limit(&self) -> usize {
        self.target * 2
    }

    /// Adds a ready TAP found at recovery; surplus ones are retired.
    pub fn adopt_idle(&self, tap: PoolTap) {
        let mut inner = self.lock();
        if inner.idle.len() < self.keep_limit() {
            inner.idle.push_back(tap);
        } else {
            inner.retiring.push((tap, false));
        }
    }

    /// Schedules deletion of a TAP we hold.
    pub fn retire(&self, tap: PoolTap) {
        self.retire_as(tap, false);
    }

    /// Schedules deletion of a TAP, `grouped` if it is in the retire
    /// group already.
    fn retire_as(&self, tap: PoolTap, grouped: bool) {
        self.lock().retiring.push((tap, grouped));
        self.wake.notify_one();
    }

    /// Schedules deletion of a link we hold no fd for.
    pub fn retire_link(&self, ifindex: u32) {
        self.lock().retiring_links.push(ifindex);
        self.wake.notify_one();
    }

    /// Takes a TAP that was handed to another process (OpenTap: a VMM's fd
    /// refers to the agent's own open file, which nothing can revoke) out
    /// of service for good: into the retire group in one RTM_NEWLINK,
    /// deleted with the next batch, off the caller's path.
    /// Only deleting the device detaches every holder, so such a TAP never
    /// goes back to the pool: a slow, hung or hostile VMM that kept its fd
    /// would otherwise read the next sandbox's traffic and send as it.
    /// The pool refills with fresh TAPs in the background.
    ///
    /// Only the group changes here: no down (a down deactivates the
    /// device's qdiscs and waits an RCU grace period under RTNL, ~1 ms per
    /// release, and buys nothing: with no `sandboxes` entry `from_guest`
    /// drops whatever the VMM still writes, and nothing redirects to the
    /// TAP without a `by_ip` entry; the batch deletion closes it anyway).
    pub async fn discard(&self, pt: PoolTap) {
        let change = LinkChange {
            group: Some(self.retire_group),
            ..Default::default()
        };
        // Failed: the batch deletion moves it, then deletes.
        let grouped = match self.nl.set_link(pt.ifindex, change).await {
            Ok(()) => true,
            Err(error) => {
                debug!(tap = pt.tap.name(), %error, "moving a handed-out TAP to the retire group");
                false
            }
        };
        debug!(tap = pt.tap.name(), "handed-out TAP retired");
        self.retire_as(pt, grouped);
    }

    /// Resets a released TAP (pool name, down, default MTU) and returns it
    /// to the pool. When the pool is already full the same netlink message
    /// also moves it into the retire group for batched deletion, so a TAP
    /// never waits for deletion under a sandbox's name (which the next
    /// sandbox on that address would need). A failed reset goes to the
    /// abnormal queue.
    pub async fn give_back(&self, mut pt: PoolTap) {
        let surplus = self.lock().idle.len() >= self.keep_limit();
        let name = self.pool_name_of(&pt);
        match self.reset(&pt, name.as_deref(), surplus).await {
            Ok(()) => {
                if let Some(name) = name {
                    pt.tap.set_name(name);
                }
                let mut inner = self.lock();
                // Checked again here: concurrent releases all passed the
                // first check while their resets were in flight.
                if surplus || inner.idle.len() >= self.keep_limit() {
                    inner.retiring.push((pt, surplus));
                    drop(inner);
                    self.wake.notify_one();
                } else {
                    inner.idle.push_back(pt);
                    drop(inner);
                    self.changed();
                }
            }
            Err(error) => {
                warn!(tap = pt.tap.name(), %error, "TAP reset failed; will retry");
                self.lock().abnormal.push(Abnormal {
                    tap: pt,
                    attempts: 1,
                    error,
                    next_try: Instant::now() + RESET_BACKOFF,
                });
                self.wake.notify_one();
            }
        }
    }

    /// None when the TAP has a pool name already (every TAP the pool made);
    /// a fresh pool name for a TAP named after its sandbox (records from
    /// before stable names, TAPs recreated by recovery under such a name).
    fn pool_name_of(&self, pt: &PoolTap) -> Option<String> {
        match classify_tap_name(&self.prefix, pt.tap.name()) {
            TapNameKind::Pool(_) => None,
            _ => Some(self.next_pool_name()),
        }
    }

    /// Down, pool MTU, the new name if any, and the retire group if
    /// `retire` (else the idle mark): one RTM_NEWLINK. Without a rename it does not re-register
    /// the device's sysctls or wait for RCU under RTNL (~250 µs saved).
    async fn reset(&self, pt: &PoolTap, name: Option<&str>, retire: bool) -> Result<(), String> {
        self.nl
            .set_link(
                pt.ifindex,
                LinkChange {
                    name: name.map(str::to_owned),
                    mtu: Some(self.mtu),
                    up: Some(false),
                    group: retire.then_some(self.retire_group),
                    alias: (!retire).then_some(IDLE_ALIAS),
                },
            )
            .await
            .map_err(|e| crate::error_chain(&e))
    }

    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        PoolStats {
            idle: inner.idle.len(),
            target: self.target,
            abnormal: inner.abnormal.len(),
            quarantined: inner.quarantined.clone(),
            retiring: inner.retiring.len() + inner.retiring_links.len(),
            created: inner.created,
            deleted: inner.deleted,
            last_error: inner.last_error.clone(),
            refill_error: inner.refill_error.clone(),
        }
    }

    pub fn idle(&self) -> usize {
        self.lock().idle.len()
    }

    /// Background work: refill, retry abnormal TAPs, delete retired ones.
    pub async fn run(self: std::sync::Arc<Self>) {
        loop {
            self.trim();
            self.refill().await;
            self.retry_abnormal().await;
            if self.deletion_due() {
                self.delete_retired().await;
            }
            let _ = tokio::time::timeout(IDLE_TICK, self.wake.notified()).await;
        }
    }

    fn deletion_due(&self) -> bool {
        let mut inner = self.lock();
        let waiting = inner.retiring.len() + inner.retiring_links.len();
        if waiting == 0 {
            inner.retiring_since = None;
            return false;
        }
        let since = *inner.retiring_since.get_or_insert_with(Instant::now);
        waiting >= DELETE_BATCH || since.elapsed() >= DELETE_AFTER
    }

    /// Moves idle TAPs beyond the keep limit to the retire queue.
    fn trim(&self) {
        let limit = self.keep_limit();
        let mut inner = self.lock();
        let trimmed = inner.idle.len() > limit;
        while inner.idle.len() > limit {
            if let Some(pt) = inner.idle.pop_back() {
                inner.retiring.push((pt, false));
            }
        }
        drop(inner);
        if trimmed {
            self.changed();
        }
    }

    /// Creates TAPs until `target` are idle.
    pub async fn refill(&self) {
        let mut failures = 0;
        let mut created = false;
        while self.lock().idle.len() < self.target && failures < 3 {
            let name = self.next_pool_name();
            match self.create_idle(&name).await {
                Ok(pt) => {
                    let mut inner = self.lock();
                    inner.created += 1;
                    inner.refill_error = None;
                    inner.idle.push_back(pt);
                    created = true;
                }
                Err(error) => {
                    failures += 1;
                    warn!(tap = name, %error, "creating a pool TAP failed");
                    let mut inner = self.lock();
                    inner.last_error = Some(error.clone());
                    inner.refill_error = Some(error);
                }
            }
        }
        if created || failures > 0 {
            self.changed();
        }
    }

    async fn create_idle(&self, name: &str) -> Result<PoolTap, String> {
        let owned = name.to_owned();
        let pt = super::off_worker(move || create_tap(&owned))
            .await
            .map_err(|e| crate::error_chain(&e))?;
        let res = self
            .nl
            .set_link(
                pt.ifindex,
                LinkChange {
                    mtu: Some(self.mtu),
                    alias: Some(IDLE_ALIAS),
                    ..Default::default()
                },
            )
            .await;
        match res {
            Ok(()) => {
                let (dp, owned, ifindex) = (self.datapath.clone(), name.to_owned(), pt.ifindex);
                if let Err(e) = super::off_worker(move || dp.prepare_tap(&owned, ifindex)).await {
                    warn!(tap = name, error = %e, "preparing the TAP's datapath failed; ensure will retry");
                }
                debug!(tap = name, ifindex = pt.ifindex, "pool TAP created");
                Ok(pt)
            }
            Err(e) => {
                self.retire(pt);
                Err(crate::error_chain(&e))
            }
        }
    }

    async fn retry_abnormal(&self) {
        let now = Instant::now();
        let due: Vec<Abnormal> = {
            let mut inner = self.lock();
            let (due, later) = std::mem::take(&mut inner.abnormal)
                .into_iter()
                .partition(|a| a.next_try <= now);
            inner.abnormal = later;
            due
        };
        for mut a in due {
            let name = self.pool_name_of(&a.tap);
            match self.reset(&a.tap, name.as_deref(), false).await {
                Ok(()) => {
                    if let Some(name) = name {
                        a.tap.tap.set_name(name);
                    }
                    info!(
                        tap = a.tap.tap.name(),
                        attempts = a.attempts + 1,
                        "TAP reset succeeded on retry"
                    );
                    self.adopt_idle(a.tap);
                }
                Err(error) => {
                    a.attempts += 1;
                    a.error = error;
                    match after_reset_failure(a.attempts) {
                        ResetVerdict::RetryAfter(d) => {
                            a.next_try = Instant::now() + d;
                            self.lock().abnormal.push(a);
                        }
                        ResetVerdict::Quarantine => {
                            warn!(
                                tap = a.tap.tap.name(),
                                error = a.error,
                                "TAP quarantined after repeated reset failures; deleting it"
                            );
                            let mut inner = self.lock();
                            inner
                                .quarantined
                                .push((a.tap.tap.name().to_owned(), a.error));
                            inner.retiring.push((a.tap, false));
                            drop(inner);
                            self.changed();
                        }
                    }
                }
            }
        }
    }

    /// Deletes every retired TAP with one group RTM_DELLINK; falls back to
    /// one request per link if the group delete fails.
    pub async fn delete_retired(&self) {
        let (taps, links) = {
            let mut inner = self.lock();
            inner.retiring_since = None;
            (
                std::mem::take(&mut inner.retiring),
                std::mem::take(&mut inner.retiring_links),
            )
        };
        if taps.is_empty() && links.is_empty() {
            return;
        }
        let grouped: HashSet<u32> = taps
            .iter()
            .filter(|(_, g)| *g)
            .map(|(t, _)| t.ifindex)
            .collect();
        let mut indexes: Vec<u32> = taps.iter().map(|(t, _)| t.ifindex).collect();
        indexes.extend(links);
        // Close our fds first, and the fd store's copies (the last close of
        // a TAP fd waits for an RCU grace period), then into the retire
        // group, those not moved yet: a group change only (no down: the
        // group deletion closes every device in one batch, one RCU grace
        // period for all, where a down each waits one per device under
        // RTNL). Blocking work, all of it on one thread of the blocking pool.
        let (closing, nl, group) = (indexes.clone(), self.nl_bg.clone(), self.retire_group);
        let moved = super::off_worker(move || {
            drop(taps);
            let mut moved = vec![];
            for index in closing {
                crate::systemd::remove_tap_fd(index);
                if grouped.contains(&index) {
                    continue;
                }
                let change = LinkChange {
                    group: Some(group),
                    ..Default::default()
                };
                if nl.set_link_now(index, change).is_ok() {
                    moved.push(index);
                }
            }
            (grouped, moved)
        })
        .await;
        let mut grouped = moved.0;
        grouped.extend(moved.1);
        let started = Instant::now();
        let group_ok = self.nl_bg.delete_group(self.retire_group).await.is_ok();
        let mut errors = vec![];
        for &index in &indexes {
            // One by one: those the group deletion did not take (not in
            // the group, moved out of it meanwhile, or the deletion failed).
            if !(group_ok && grouped.contains(&index) && !crate::netlink::link_exists(index)) {
                match self.nl_bg.delete_link(index).await {
                    // Gone already (a retired veth whose namespace was deleted).
                    Err(e) if e.errno() == Some(libc::ENODEV) => {}
                    Err(e) => {
                        errors.push(crate::error_chain(&e));
                        continue;
                    }
                    Ok(()) => {}
                }
            }
            // The datapath's record of the device goes with it (the
            // reaper only looks for leftovers now and then).
            self.datapath.forget_attachment(index);
        }
        let deleted = indexes.len() - errors.len();
        info!(
            deleted,
            failed = errors.len(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "retired TAPs deleted"
        );
        let mut inner = self.lock();
        inner.deleted += deleted as u64;
        if let Some(e) = errors.pop() {
            inner.last_error = Some(e);
        }
    }
}

/// Creates a persistent TAP, looks up its ifindex and pushes its fd into
/// the service manager's fd store (when there is one), so a restart gets
/// the very same fd back instead of reopening the TAP.
pub fn create_tap(name: &str) -> Result<PoolTap, crate::tap::TapError> {
    let tap = Tap::create(name)?;
    disable_ipv6(name);
    let ifindex =
        nix::net::if_::if_nametoindex(name).map_err(|e| crate::tap::TapError::SetIff {
            name: name.into(),
            source: e.into(),
        })?;
    store_fd(ifindex, &tap);
    Ok(PoolTap { tap, ifindex })
}

/// Creates a persistent TAP that `owner` may attach to by name, and
/// closes the agent's fd: the VMM opens the device itself (Firecracker's
/// `host_dev_name`, QEMU's `ifname=`). Its ifindex. Nothing goes into the
/// fd store. A failed step leaves no device behind.
pub fn create_by_name(name: &str, owner: TapOwner) -> Result<u32, crate::tap::TapError> {
    let tap = Tap::create(name)?;
    let done = tap.set_owner(owner.uid, owner.gid).and_then(|()| {
        nix::net::if_::if_nametoindex(name).map_err(|e| crate::tap::TapError::SetIff {
            name: name.into(),
            source: e.into(),
        })
    });
    match done {
        Ok(ifindex) => {
            disable_ipv6(name);
            Ok(ifindex)
        }
        Err(e) => {
            // Gone with the fd below.
            let _ = tap.unpersist();
            Err(e)
        }
    }
}

/// Gives a TAP handed over by name a new owner: attaches to it for the
/// two ioctls. EBUSY (TUNSETIFF) while a VMM holds it: the owner of an
/// attached queue is never changed under it.
pub fn set_by_name_owner(name: &str, owner: TapOwner) -> Result<(), crate::tap::TapError> {
    Tap::open_existing(name)?.set_owner(owner.uid, owner.gid)
}

/// Replaces `path` with `bytes`, fsynced, file and directory.
fn write_durably(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Turns IPv6 off on a new (still down) TAP. Guests are IPv4-only and the
/// datapath drops their IPv6; left on, every TAP brought up gets its own
/// fe80::/64 and ff00::/8 routes, which share one FIB node across all
/// devices, so each link-up costs O(number of TAPs) under RTNL (measured:
/// cold EnsureNetwork core time 1.66 ms with it vs 0.87 ms without, at
/// 3,000 networks). The setting follows the device across renames.
fn disable_ipv6(name: &str) {
    if let Err(error) = crate::sysctl::disable_ipv6(name) {
        debug!(tap = name, %error, "could not disable IPv6 on the TAP");
    }
}

/// Pushes a TAP fd to the fd store; failure only costs a reopen after a
/// restart, so it is logged, not fatal.
pub fn store_fd(ifindex: u32, tap: &Tap) {
    if let Err(error) = crate::systemd::store_tap_fd(ifindex, tap.as_fd()) {
        warn!(tap = tap.name(), %error, "could not push the TAP fd to the fd store");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_failures_back_off_then_quarantine() {
        assert_eq!(
            after_reset_failure(1),
            ResetVerdict::RetryAfter(RESET_BACKOFF)
        );
        assert_eq!(
            after_reset_failure(2),
            ResetVerdict::RetryAfter(RESET_BACKOFF * 2)
        );
        assert_eq!(
            after_reset_failure(MAX_RESET_ATTEMPTS),
            ResetVerdict::Quarantine
        );
        assert_eq!(after_reset_failure(100), ResetVerdict::Quarantine);
    }
}
