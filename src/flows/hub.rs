//! See mod.rs. The hub: the recent history (a bounded share per sandbox),
//! the live subscribers (bounded queues, losses counted and reported), the
//! journal (rate-limited per sandbox) and the counters.
//!
//! Locking: one short `std::sync::Mutex` for the history, stats and
//! journal budgets, one for the subscriber list and one per subscriber
//! queue. They are never held together except list → queue, and nothing
//! is written to the journal while any of them is held. `publish` never
//! waits for a subscriber: a full queue loses the record.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use super::record::{FlowEvent, FlowRecord};

pub use crate::config::FlowLog;

/// Records older than this leave the history.
const MAX_AGE: Duration = Duration::from_secs(3600);
/// A sandbox's stats entry goes when it has no history and no activity
/// for this long.
const STATS_IDLE: Duration = Duration::from_secs(3600);
/// The sweep over every sandbox (age-out, idle stats) runs at most this
/// often from `publish`; `tick` and the readers always sweep.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A sandbox's share of a subscriber's queue is at least this.
const MIN_SUBSCRIBER_SHARE: usize = 64;

/// The hub's bounds.
#[derive(Debug, Clone, Copy)]
pub struct HubLimits {
    /// Records kept in the history per sandbox (its share).
    pub history_per_sandbox: usize,
    /// Records kept in the history in all.
    pub history_total: usize,
    /// Records a subscriber may have queued before it loses the next ones.
    pub subscriber_queue: usize,
    /// Journal: records per second per sandbox, and the burst.
    pub journal_rate: u32,
    pub journal_burst: u32,
}

/// Which records a reader wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub sandbox_id: Option<String>,
    /// Refused records only.
    pub denied: bool,
}

impl Filter {
    /// Whether the filter takes `rec`.
    pub fn takes(&self, rec: &FlowRecord) -> bool {
        self.takes_sandbox(&rec.sandbox_id) && (!self.denied || rec.refused.is_some())
    }

    /// Whether the filter could take any of the sandbox's records.
    pub fn takes_sandbox(&self, sandbox_id: &str) -> bool {
        self.sandbox_id.as_deref().is_none_or(|s| s == sandbox_id)
    }
}

/// What a subscriber gets next.
#[derive(Debug, Clone)]
pub enum Delivery {
    Record(Arc<FlowRecord>),
    /// It lost this many records (its queue was full) since the last
    /// delivery.
    Lost(u64),
    /// The hub is gone (the agent is stopping).
    Closed,
}

/// A sandbox's flow-log counters (metrics, GetNetwork's traffic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SandboxFlowStats {
    /// Records made from the datapath's events and the reaper's ends.
    pub records: u64,
    /// Events the datapath did not emit (the sandbox's token bucket was
    /// empty, or the ring was full).
    pub lost: u64,
    /// Records the journal's rate limit suppressed.
    pub journal_suppressed: u64,
}

pub struct FlowHub {
    limits: HubLimits,
    journal: AtomicU8,
    inner: Mutex<Inner>,
    subs: Arc<Mutex<Subscribers>>,
    total_records: AtomicU64,
    total_lost_datapath: AtomicU64,
    total_lost_subscribers: AtomicU64,
    /// Record lines written to the journal (tests).
    journal_written: AtomicU64,
    /// "N suppressed" lines written to the journal (tests).
    journal_summaries: AtomicU64,
}

pub struct Subscription {
    id: u64,
    shared: Arc<SubShared>,
    subs: Weak<Mutex<Subscribers>>,
}

/// The clock: monotonic for budgets and idleness, wall-clock for the
/// records' age. Injected by the tests.
#[derive(Debug, Clone, Copy)]
struct Now {
    mono: Instant,
    unix_ns: u64,
}

impl Now {
    fn real() -> Now {
        let unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Now {
            mono: Instant::now(),
            unix_ns,
        }
    }

    /// Records older than this are gone.
    fn cutoff_unix_ns(&self) -> u64 {
        let age = u64::try_from(MAX_AGE.as_nanos()).unwrap_or(u64::MAX);
        self.unix_ns.saturating_sub(age)
    }
}

#[derive(Default)]
struct Inner {
    sandboxes: HashMap<Arc<str>, SandboxState>,
    /// (history length, sandbox) of every sandbox with history: the
    /// largest is evicted from first when the total is over.
    by_len: BTreeSet<(usize, Arc<str>)>,
    total: usize,
    seq: u64,
    last_sweep: Option<Instant>,
}

struct SandboxState {
    /// (publish sequence, record), publish order.
    history: VecDeque<(u64, Arc<FlowRecord>)>,
    stats: SandboxFlowStats,
    last_activity: Instant,
    /// Journal budget.
    tokens: f64,
    refilled: Instant,
    /// Suppressed since the last summary.
    pending_suppressed: u64,
}

impl SandboxState {
    fn new(now: Instant, burst: f64) -> SandboxState {
        SandboxState {
            history: VecDeque::new(),
            stats: SandboxFlowStats::default(),
            last_activity: now,
            tokens: burst,
            refilled: now,
            pending_suppressed: 0,
        }
    }
}

#[derive(Default)]
struct Subscribers {
    next_id: u64,
    list: HashMap<u64, Arc<SubShared>>,
    closed: bool,
}

struct SubShared {
    filter: Filter,
    queue: Mutex<SubQueue>,
    notify: Notify,
}

#[derive(Default)]
struct SubQueue {
    records: VecDeque<Arc<FlowRecord>>,
    /// Queued records per sandbox (entries at zero are removed).
    per_sandbox: HashMap<String, usize>,
    lost: u64,
    closed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these leaves consistent-enough state
    // (counters and queues); keep serving rather than cascade.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn level_to_u8(l: FlowLog) -> u8 {
    match l {
        FlowLog::Off => 0,
        FlowLog::Denied => 1,
        FlowLog::All => 2,
    }
}

fn level_from_u8(v: u8) -> FlowLog {
    match v {
        0 => FlowLog::Off,
        1 => FlowLog::Denied,
        _ => FlowLog::All,
    }
}

/// Whether the journal level takes `rec`.
fn journal_takes(level: FlowLog, rec: &FlowRecord) -> bool {
    match level {
        FlowLog::Off => false,
        FlowLog::Denied => rec.refused.is_some(),
        FlowLog::All => true,
    }
}

impl Default for HubLimits {
    fn default() -> Self {
        HubLimits {
            history_per_sandbox: 512,
            history_total: 65_536,
            subscriber_queue: 4096,
            journal_rate: 20,
            journal_burst: 100,
        }
    }
}

impl Inner {
    fn set_len(&mut self, key: &Arc<str>, old: usize, new: usize) {
        if old > 0 {
            self.by_len.remove(&(old, key.clone()));
        }
        if new > 0 {
            self.by_len.insert((new, key.clone()));
        }
    }

    /// Drops the sandbox's oldest record.
    fn pop_oldest(&mut self, key: &Arc<str>) {
        let Some(sb) = self.sandboxes.get_mut(key) else {
            return;
        };
        let old = sb.history.len();
        if sb.history.pop_front().is_none() {
            return;
        }
        self.total -= 1;
        self.set_len(key, old, old - 1);
    }

    /// Drops the sandbox's records older than an hour.
    fn age_out(&mut self, key: &Arc<str>, cutoff_unix_ns: u64) {
        let Some(sb) = self.sandboxes.get_mut(key) else {
            return;
        };
        let old = sb.history.len();
        while sb
            .history
            .front()
            .is_some_and(|(_, r)| r.time_unix_ns < cutoff_unix_ns)
        {
            sb.history.pop_front();
        }
        let new = sb.history.len();
        if new != old {
            self.total -= old - new;
            self.set_len(key, old, new);
        }
    }

    /// Age-out over every sandbox, and drops the stats of sandboxes with
    /// no history, nothing pending and no activity for an hour.
    fn sweep(&mut self, now: Now) {
        self.last_sweep = Some(now.mono);
        let cutoff = now.cutoff_unix_ns();
        let keys: Vec<Arc<str>> = self.sandboxes.keys().cloned().collect();
        for key in &keys {
            self.age_out(key, cutoff);
        }
        self.sandboxes.retain(|_, sb| {
            !sb.history.is_empty()
                || sb.pending_suppressed > 0
                || now.mono.saturating_duration_since(sb.last_activity) < STATS_IDLE
        });
    }

    fn maybe_sweep(&mut self, now: Now) {
        let due = self
            .last_sweep
            .is_none_or(|t| now.mono.saturating_duration_since(t) >= SWEEP_EVERY);
        if due {
            self.sweep(now);
        }
    }
}

impl FlowHub {
    /// A hub writing `journal` records to the journal.
    pub fn new(limits: HubLimits, journal: FlowLog) -> Arc<FlowHub> {
        Arc::new(FlowHub {
            limits,
            journal: AtomicU8::new(level_to_u8(journal)),
            inner: Mutex::new(Inner::default()),
            subs: Arc::new(Mutex::new(Subscribers::default())),
            total_records: AtomicU64::new(0),
            total_lost_datapath: AtomicU64::new(0),
            total_lost_subscribers: AtomicU64::new(0),
            journal_written: AtomicU64::new(0),
            journal_summaries: AtomicU64::new(0),
        })
    }

    /// One record: into the history, to every subscriber whose filter
    /// takes it (a full queue: the subscriber loses it, counted), to the
    /// journal if `flow_log` takes it and the sandbox's journal budget
    /// allows. Never waits for a subscriber.
    pub fn publish(&self, rec: FlowRecord) {
        self.publish_at(rec, Now::real());
    }

    fn journal_burst(&self) -> f64 {
        f64::from(self.limits.journal_burst.max(1))
    }

    fn publish_at(&self, rec: FlowRecord, now: Now) {
        let rec = Arc::new(rec);
        self.total_records.fetch_add(1, Ordering::Relaxed);
        let journal = journal_takes(self.journal(), &rec);
        let write = self.record_history(&rec, journal, now);
        self.deliver(&rec);
        if write {
            self.journal_written.fetch_add(1, Ordering::Relaxed);
            write_journal(&rec);
        }
    }

    /// History, stats and the journal budget. Whether to write the record
    /// to the journal.
    fn record_history(&self, rec: &Arc<FlowRecord>, journal: bool, now: Now) -> bool {
        let burst = self.journal_burst();
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        inner.maybe_sweep(now);
        let key: Arc<str> = match inner.sandboxes.get_key_value(rec.sandbox_id.as_str()) {
            Some((k, _)) => k.clone(),
            None => {
                let k: Arc<str> = Arc::from(rec.sandbox_id.as_str());
                inner
                    .sandboxes
                    .insert(k.clone(), SandboxState::new(now.mono, burst));
                k
            }
        };
        inner.age_out(&key, now.cutoff_unix_ns());
        inner.seq += 1;
        let seq = inner.seq;
        let sb = inner.sandboxes.get_mut(&key).expect("inserted above");
        sb.stats.records += 1;
        sb.last_activity = now.mono;
        let write = journal && {
            let elapsed = now.mono.saturating_duration_since(sb.refilled);
            sb.refilled = now.mono;
            sb.tokens = (sb.tokens + elapsed.as_secs_f64() * f64::from(self.limits.journal_rate))
                .min(burst);
            if sb.tokens >= 1.0 {
                sb.tokens -= 1.0;
                true
            } else {
                sb.stats.journal_suppressed += 1;
                sb.pending_suppressed += 1;
                false
            }
        };
        let old = sb.history.len();
        sb.history.push_back((seq, rec.clone()));
        inner.total += 1;
        inner.set_len(&key, old, old + 1);
        while inner
            .sandboxes
            .get(&key)
            .is_some_and(|sb| sb.history.len() > self.limits.history_per_sandbox)
        {
            inner.pop_oldest(&key);
        }
        while inner.total > self.limits.history_total {
            let Some((_, largest)) = inner.by_len.last().cloned() else {
                break;
            };
            inner.pop_oldest(&largest);
        }
        write
    }

    /// To every subscriber whose filter takes the record.
    fn deliver(&self, rec: &Arc<FlowRecord>) {
        let limit = self.limits.subscriber_queue;
        let share = (limit / 8).max(MIN_SUBSCRIBER_SHARE);
        let subs = lock(&self.subs);
        for sub in subs.list.values() {
            if !sub.filter.takes(rec) {
                continue;
            }
            let mut q = lock(&sub.queue);
            if q.closed {
                continue;
            }
            let mine = q.per_sandbox.get(&rec.sandbox_id).copied().unwrap_or(0);
            if q.records.len() >= limit || mine >= share {
                q.lost += 1;
                self.total_lost_subscribers.fetch_add(1, Ordering::Relaxed);
            } else {
                q.records.push_back(rec.clone());
                *q.per_sandbox.entry(rec.sandbox_id.clone()).or_insert(0) += 1;
            }
            drop(q);
            sub.notify.notify_one();
        }
    }

    /// The datapath did not emit `n` of the sandbox's events (its bucket
    /// was empty or the ring full): counted, and subscribers whose filter
    /// takes the sandbox are told (`Delivery::Lost`).
    pub fn note_lost(&self, sandbox_id: &str, n: u64) {
        self.note_lost_at(sandbox_id, n, Now::real());
    }

    fn note_lost_at(&self, sandbox_id: &str, n: u64, now: Now) {
        if n == 0 {
            return;
        }
        self.total_lost_datapath.fetch_add(n, Ordering::Relaxed);
        {
            let burst = self.journal_burst();
            let mut inner = lock(&self.inner);
            let sb = inner
                .sandboxes
                .entry(Arc::from(sandbox_id))
                .or_insert_with(|| SandboxState::new(now.mono, burst));
            sb.stats.lost += n;
            sb.last_activity = now.mono;
        }
        let subs = lock(&self.subs);
        for sub in subs.list.values() {
            if !sub.filter.takes_sandbox(sandbox_id) {
                continue;
            }
            let mut q = lock(&sub.queue);
            if q.closed {
                continue;
            }
            q.lost += n;
            drop(q);
            sub.notify.notify_one();
        }
    }

    /// Records published from now on that `filter` takes.
    pub fn subscribe(&self, filter: Filter) -> Subscription {
        let mut subs = lock(&self.subs);
        let shared = Arc::new(SubShared {
            filter,
            queue: Mutex::new(SubQueue {
                closed: subs.closed,
                ..SubQueue::default()
            }),
            notify: Notify::new(),
        });
        subs.next_id += 1;
        let id = subs.next_id;
        if !subs.closed {
            subs.list.insert(id, shared.clone());
        }
        Subscription {
            id,
            shared,
            subs: Arc::downgrade(&self.subs),
        }
    }

    /// The kept records `filter` takes with `time_unix_ns >= since`, oldest
    /// first.
    pub fn history(&self, filter: &Filter, since_unix_ns: u64) -> Vec<Arc<FlowRecord>> {
        self.history_at(filter, since_unix_ns, Now::real())
    }

    fn history_at(&self, filter: &Filter, since_unix_ns: u64, now: Now) -> Vec<Arc<FlowRecord>> {
        let since = since_unix_ns.max(now.cutoff_unix_ns());
        let mut inner = lock(&self.inner);
        inner.sweep(now);
        let mut out: Vec<(u64, u64, Arc<FlowRecord>)> = Vec::new();
        let mut take = |sb: &SandboxState| {
            out.extend(
                sb.history
                    .iter()
                    .filter(|(_, r)| r.time_unix_ns >= since && filter.takes(r))
                    .map(|(seq, r)| (r.time_unix_ns, *seq, r.clone())),
            );
        };
        match &filter.sandbox_id {
            Some(id) => {
                if let Some(sb) = inner.sandboxes.get(id.as_str()) {
                    take(sb);
                }
            }
            None => inner.sandboxes.values().for_each(&mut take),
        }
        drop(inner);
        out.sort_unstable_by_key(|(t, seq, _)| (*t, *seq));
        out.into_iter().map(|(_, _, r)| r).collect()
    }

    /// Every sandbox's counters (metrics).
    pub fn stats(&self) -> Vec<(String, SandboxFlowStats)> {
        let inner = lock(&self.inner);
        let mut out: Vec<_> = inner
            .sandboxes
            .iter()
            .map(|(k, sb)| (k.to_string(), sb.stats))
            .collect();
        drop(inner);
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// One sandbox's counters.
    pub fn stats_of(&self, sandbox_id: &str) -> SandboxFlowStats {
        lock(&self.inner)
            .sandboxes
            .get(sandbox_id)
            .map(|sb| sb.stats)
            .unwrap_or_default()
    }

    /// Node-wide counters since the start: (records published, events the
    /// datapath lost, records subscribers lost to full queues).
    pub fn totals(&self) -> (u64, u64, u64) {
        (
            self.total_records.load(Ordering::Relaxed),
            self.total_lost_datapath.load(Ordering::Relaxed),
            self.total_lost_subscribers.load(Ordering::Relaxed),
        )
    }

    /// Writes the journal's "N suppressed" summaries of sandboxes whose
    /// records were suppressed since the last call; the agent calls it
    /// every second.
    pub fn tick(&self) {
        self.tick_at(Now::real());
    }

    fn tick_at(&self, now: Now) {
        let mut summaries: Vec<(Arc<str>, u64)> = Vec::new();
        {
            let mut inner = lock(&self.inner);
            for (k, sb) in inner.sandboxes.iter_mut() {
                if sb.pending_suppressed > 0 {
                    summaries.push((k.clone(), std::mem::take(&mut sb.pending_suppressed)));
                }
            }
            inner.sweep(now);
        }
        summaries.sort_unstable();
        for (sandbox_id, n) in summaries {
            self.journal_summaries.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                sandbox_id = &*sandbox_id,
                suppressed = n,
                "flow: {sandbox_id}: {n} flow records suppressed (rate limit)"
            );
        }
    }

    /// The journal level now.
    pub fn journal(&self) -> FlowLog {
        level_from_u8(self.journal.load(Ordering::Relaxed))
    }

    /// Changes the journal level (records published from now on).
    pub fn set_journal(&self, level: FlowLog) {
        self.journal.store(level_to_u8(level), Ordering::Relaxed);
    }

    /// Ends every subscription (`Delivery::Closed`).
    pub fn close(&self) {
        let list = {
            let mut subs = lock(&self.subs);
            subs.closed = true;
            std::mem::take(&mut subs.list)
        };
        for sub in list.values() {
            lock(&sub.queue).closed = true;
            sub.notify.notify_one();
        }
    }
}

impl Drop for FlowHub {
    fn drop(&mut self) {
        self.close();
    }
}

/// One journal line for the record.
fn write_journal(rec: &FlowRecord) {
    let reason = rec.refused.map(|r| r.as_str()).unwrap_or("");
    let node = rec.node.map(|n| n.to_string()).unwrap_or_default();
    let dns_name = rec.dns_name.as_deref().unwrap_or("");
    let mut msg = format!(
        "flow: {} {} {} {} -> {} {}",
        rec.sandbox_id,
        rec.event.as_str(),
        rec.protocol,
        rec.guest,
        rec.remote,
        rec.verdict()
    );
    if let Some(r) = rec.refused {
        let _ = write!(msg, " ({})", r.as_str());
    }
    if let Some(d) = &rec.dns_name {
        let _ = write!(msg, " {d}");
    }
    if rec.event == FlowEvent::End {
        let t = rec.end.unwrap_or_default();
        tracing::info!(
            sandbox_id = rec.sandbox_id.as_str(),
            flow_event = rec.event.as_str(),
            verdict = rec.verdict(),
            reason,
            protocol = rec.protocol.as_str(),
            direction = rec.direction.as_str(),
            family = rec.family,
            guest = %rec.guest,
            remote = %rec.remote,
            node = node.as_str(),
            dns_name,
            bytes_out = t.bytes_out,
            packets_out = t.packets_out,
            bytes_in = t.bytes_in,
            packets_in = t.packets_in,
            duration_ms = t.duration_ms,
            "{msg}"
        );
    } else {
        tracing::info!(
            sandbox_id = rec.sandbox_id.as_str(),
            flow_event = rec.event.as_str(),
            verdict = rec.verdict(),
            reason,
            protocol = rec.protocol.as_str(),
            direction = rec.direction.as_str(),
            family = rec.family,
            guest = %rec.guest,
            remote = %rec.remote,
            node = node.as_str(),
            dns_name,
            "{msg}"
        );
    }
}

impl Subscription {
    /// The next record, loss report or the end.
    pub async fn next(&mut self) -> Delivery {
        loop {
            {
                let mut q = lock(&self.shared.queue);
                if q.lost > 0 {
                    return Delivery::Lost(std::mem::take(&mut q.lost));
                }
                if let Some(rec) = q.records.pop_front() {
                    if let Some(n) = q.per_sandbox.get_mut(&rec.sandbox_id) {
                        *n -= 1;
                        if *n == 0 {
                            q.per_sandbox.remove(&rec.sandbox_id);
                        }
                    }
                    return Delivery::Record(rec);
                }
                if q.closed {
                    return Delivery::Closed;
                }
            }
            // notify_one keeps a permit when nobody waits, so a record
            // queued between the check above and here is not missed.
            self.shared.notify.notified().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(subs) = self.subs.upgrade() {
            lock(&subs).list.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use futures::FutureExt;

    use super::super::record::{Direction, Endpoint, Reason, Totals};
    use super::*;

    const HOUR_NS: u64 = 3600 * 1_000_000_000;
    const T0: u64 = 1_700_000_000 * 1_000_000_000;

    fn rec(sandbox: &str, time_unix_ns: u64, refused: bool) -> FlowRecord {
        FlowRecord {
            time_unix_ns,
            sandbox_id: sandbox.to_string(),
            event: if refused {
                FlowEvent::Refused
            } else {
                FlowEvent::Start
            },
            family: 4,
            protocol: "tcp".into(),
            direction: Direction::Egress,
            guest: Endpoint {
                ip: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
                port: 40000,
            },
            remote: Endpoint {
                ip: IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)),
                port: 443,
            },
            node: None,
            refused: refused.then_some(Reason::Policy),
            dns_name: Some("one.one.one.one".into()),
            end: None,
        }
    }

    fn at(mono: Instant, unix_ns: u64) -> Now {
        Now { mono, unix_ns }
    }

    fn limits(per_sandbox: usize, total: usize, queue: usize) -> HubLimits {
        HubLimits {
            history_per_sandbox: per_sandbox,
            history_total: total,
            subscriber_queue: queue,
            journal_rate: 20,
            journal_burst: 100,
        }
    }

    fn all() -> Filter {
        Filter::default()
    }

    fn only(sandbox: &str) -> Filter {
        Filter {
            sandbox_id: Some(sandbox.into()),
            denied: false,
        }
    }

    impl FlowHub {
        fn history_len(&self) -> usize {
            let inner = lock(&self.inner);
            let sum: usize = inner.sandboxes.values().map(|s| s.history.len()).sum();
            assert_eq!(sum, inner.total, "total out of step");
            inner.total
        }

        fn subscriber_count(&self) -> usize {
            lock(&self.subs).list.len()
        }

        fn journal_counts(&self) -> (u64, u64) {
            (
                self.journal_written.load(Ordering::Relaxed),
                self.journal_summaries.load(Ordering::Relaxed),
            )
        }
    }

    /// What the subscription has ready now, without waiting.
    fn ready(sub: &mut Subscription) -> Option<Delivery> {
        sub.next().now_or_never()
    }

    fn drain_records(sub: &mut Subscription) -> (Vec<Arc<FlowRecord>>, u64) {
        let mut recs = Vec::new();
        let mut lost = 0;
        while let Some(d) = ready(sub) {
            match d {
                Delivery::Record(r) => recs.push(r),
                Delivery::Lost(n) => lost += n,
                Delivery::Closed => break,
            }
        }
        (recs, lost)
    }

    #[test]
    fn flooder_never_evicts_quiet_sandboxes() {
        let hub = FlowHub::new(limits(5000, 1000, 4096), FlowLog::Off);
        let now = at(Instant::now(), T0);
        for q in ["q1", "q2", "q3"] {
            for i in 0..10 {
                hub.publish_at(rec(q, T0 + i, false), now);
            }
        }
        for i in 0..100_000u64 {
            hub.publish_at(rec("flood", T0 + 100 + i, false), now);
            assert!(hub.history_len() <= 1000 || i < 1000);
        }
        assert_eq!(hub.history_len(), 1000);
        for q in ["q1", "q2", "q3"] {
            let h = hub.history_at(&only(q), 0, now);
            assert_eq!(h.len(), 10, "{q}");
            assert_eq!(h[0].time_unix_ns, T0);
        }
        let f = hub.history_at(&only("flood"), 0, now);
        assert_eq!(f.len(), 970);
        // The newest are kept, oldest first.
        assert_eq!(f.last().unwrap().time_unix_ns, T0 + 100 + 99_999);
        assert_eq!(f[0].time_unix_ns, T0 + 100 + 100_000 - 970);
        assert_eq!(hub.stats_of("flood").records, 100_000);
        assert_eq!(hub.totals().0, 100_030);
    }

    #[test]
    fn total_bound_evicts_from_the_largest_and_per_sandbox_share_holds() {
        let hub = FlowHub::new(limits(4, 10, 4096), FlowLog::Off);
        let now = at(Instant::now(), T0);
        for i in 0..20 {
            hub.publish_at(rec("a", T0 + i, false), now);
        }
        assert_eq!(hub.history_at(&only("a"), 0, now).len(), 4);
        for s in ["b", "c"] {
            for i in 0..4 {
                hub.publish_at(rec(s, T0 + 100 + i, false), now);
            }
        }
        assert_eq!(hub.history_len(), 10);
        // a, b, c at 4, 4, 2 after the c's: the two evictions took one
        // each from the largest.
        let lens: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|s| hub.history_at(&only(s), 0, now).len())
            .collect();
        assert_eq!(lens.iter().sum::<usize>(), 10);
        assert!(lens.iter().all(|&l| (3..=4).contains(&l)), "{lens:?}");
    }

    #[test]
    fn history_ages_out_after_an_hour() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let t = Instant::now();
        for i in 0..5 {
            hub.publish_at(rec("a", T0 + i, false), at(t, T0 + i));
        }
        hub.publish_at(rec("b", T0 + HOUR_NS, false), at(t, T0 + HOUR_NS));
        let later = at(t + Duration::from_secs(3600), T0 + HOUR_NS + 2);
        // Records at T0 and T0+1 are older than an hour now.
        let h = hub.history_at(&all(), 0, later);
        let times: Vec<u64> = h.iter().map(|r| r.time_unix_ns).collect();
        assert_eq!(times, vec![T0 + 2, T0 + 3, T0 + 4, T0 + HOUR_NS]);
        assert_eq!(hub.history_len(), 4);
        let much_later = at(t + Duration::from_secs(7300), T0 + 3 * HOUR_NS);
        assert!(hub.history_at(&all(), 0, much_later).is_empty());
        assert_eq!(hub.history_len(), 0);
        // No history and idle for an hour: the stats entries go too.
        hub.tick_at(much_later);
        assert!(hub.stats().is_empty());
        assert_eq!(hub.stats_of("a"), SandboxFlowStats::default());
    }

    #[test]
    fn stats_entries_stay_while_active() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let t = Instant::now();
        hub.note_lost_at("a", 3, at(t, T0));
        hub.tick_at(at(t + Duration::from_secs(1800), T0));
        assert_eq!(hub.stats_of("a").lost, 3);
        hub.tick_at(at(t + Duration::from_secs(3601), T0));
        assert_eq!(hub.stats(), vec![]);
        assert_eq!(hub.totals().1, 3);
    }

    #[test]
    fn history_filters() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let now = at(Instant::now(), T0 + 100);
        hub.publish_at(rec("a", T0 + 5, false), now);
        hub.publish_at(rec("b", T0 + 1, true), now);
        hub.publish_at(rec("a", T0 + 3, true), now);
        hub.publish_at(rec("b", T0 + 7, false), now);
        let times = |f: &Filter, since: u64| -> Vec<(String, u64)> {
            hub.history_at(f, since, now)
                .iter()
                .map(|r| (r.sandbox_id.clone(), r.time_unix_ns))
                .collect()
        };
        let s = |id: &str, t: u64| (id.to_string(), T0 + t);
        assert_eq!(
            times(&all(), 0),
            vec![s("b", 1), s("a", 3), s("a", 5), s("b", 7)]
        );
        assert_eq!(times(&only("a"), 0), vec![s("a", 3), s("a", 5)]);
        assert_eq!(times(&only("a"), T0 + 4), vec![s("a", 5)]);
        assert_eq!(times(&only("nobody"), 0), vec![]);
        let denied = Filter {
            sandbox_id: None,
            denied: true,
        };
        assert_eq!(times(&denied, 0), vec![s("b", 1), s("a", 3)]);
        assert_eq!(times(&denied, T0 + 2), vec![s("a", 3)]);
        let b_denied = Filter {
            sandbox_id: Some("b".into()),
            denied: true,
        };
        assert_eq!(times(&b_denied, 0), vec![s("b", 1)]);
    }

    #[tokio::test]
    async fn subscribers_get_what_their_filter_takes() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let mut a = hub.subscribe(only("a"));
        let mut denied = hub.subscribe(Filter {
            sandbox_id: None,
            denied: true,
        });
        hub.publish(rec("a", T0, false));
        hub.publish(rec("b", T0 + 1, true));
        hub.publish(rec("a", T0 + 2, true));
        let (ra, la) = drain_records(&mut a);
        assert_eq!(la, 0);
        assert_eq!(
            ra.iter().map(|r| r.time_unix_ns).collect::<Vec<_>>(),
            vec![T0, T0 + 2]
        );
        let (rd, _) = drain_records(&mut denied);
        assert_eq!(
            rd.iter().map(|r| r.time_unix_ns).collect::<Vec<_>>(),
            vec![T0 + 1, T0 + 2]
        );
    }

    #[tokio::test]
    async fn slow_subscriber_loses_records_counted_others_get_all() {
        let hub = FlowHub::new(limits(512, 65_536, 64), FlowLog::Off);
        let mut slow = hub.subscribe(all());
        let mut fast = hub.subscribe(all());
        let mut got = Vec::new();
        for round in 0..4u64 {
            for i in 0..50 {
                hub.publish(rec("a", T0 + round * 50 + i, false));
            }
            let (r, lost) = drain_records(&mut fast);
            assert_eq!(lost, 0);
            got.extend(r);
        }
        assert_eq!(got.len(), 200);
        assert!(
            got.windows(2)
                .all(|w| w[0].time_unix_ns < w[1].time_unix_ns)
        );
        // The slow one: told first, then its 64 queued records.
        match ready(&mut slow) {
            Some(Delivery::Lost(n)) => assert_eq!(n, 136),
            other => panic!("expected Lost(136), got {other:?}"),
        }
        let (r, lost) = drain_records(&mut slow);
        assert_eq!(lost, 0);
        assert_eq!(r.len(), 64);
        assert_eq!(r[0].time_unix_ns, T0);
        assert!(ready(&mut slow).is_none(), "nothing more, it waits");
        assert_eq!(hub.totals(), (200, 0, 136));
        // It has room again.
        hub.publish(rec("a", T0 + 1000, false));
        assert!(matches!(ready(&mut slow), Some(Delivery::Record(_))));
    }

    #[tokio::test]
    async fn flooder_cannot_push_out_a_victims_record() {
        // Queue 1024: one sandbox's share is 128.
        let hub = FlowHub::new(limits(512, 65_536, 1024), FlowLog::Off);
        let mut sub = hub.subscribe(all());
        hub.publish(rec("victim", T0, true));
        for i in 0..10_000 {
            hub.publish(rec("flood", T0 + 1 + i, false));
        }
        hub.publish(rec("victim", T0 + 20_000, true));
        match ready(&mut sub) {
            Some(Delivery::Lost(n)) => assert_eq!(n, 10_000 - 128),
            other => panic!("expected Lost, got {other:?}"),
        }
        let (r, lost) = drain_records(&mut sub);
        assert_eq!(lost, 0);
        assert_eq!(r.len(), 130);
        let victims: Vec<u64> = r
            .iter()
            .filter(|r| r.sandbox_id == "victim")
            .map(|r| r.time_unix_ns)
            .collect();
        assert_eq!(victims, vec![T0, T0 + 20_000]);
        assert_eq!(r.iter().filter(|r| r.sandbox_id == "flood").count(), 128);
        // Small queues: the share is at least 64 (and the queue bounds it).
        let hub = FlowHub::new(limits(512, 65_536, 100), FlowLog::Off);
        let mut sub = hub.subscribe(all());
        for i in 0..100 {
            hub.publish(rec("flood", T0 + i, false));
        }
        hub.publish(rec("victim", T0 + 200, false));
        let (r, lost) = drain_records(&mut sub);
        assert_eq!(lost, 36);
        assert_eq!(r.len(), 65);
        assert_eq!(r.last().unwrap().sandbox_id, "victim");
    }

    #[tokio::test]
    async fn note_lost_reaches_the_right_subscribers() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let mut everyone = hub.subscribe(all());
        let mut a = hub.subscribe(only("a"));
        let mut a_denied = hub.subscribe(Filter {
            sandbox_id: Some("a".into()),
            denied: true,
        });
        let mut b = hub.subscribe(only("b"));
        hub.note_lost("a", 5);
        hub.note_lost("a", 2);
        hub.note_lost("c", 0);
        for sub in [&mut everyone, &mut a, &mut a_denied] {
            assert!(matches!(ready(sub), Some(Delivery::Lost(7))));
            assert!(ready(sub).is_none());
        }
        assert!(ready(&mut b).is_none());
        assert_eq!(hub.stats_of("a").lost, 7);
        assert_eq!(hub.stats_of("b").lost, 0);
        assert_eq!(hub.totals(), (0, 7, 0));
    }

    #[tokio::test]
    async fn a_waiting_subscriber_wakes() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let mut sub = hub.subscribe(all());
        let task = tokio::spawn(async move {
            let first = sub.next().await;
            let second = sub.next().await;
            let third = sub.next().await;
            (first, second, third)
        });
        tokio::task::yield_now().await;
        hub.note_lost("a", 1);
        hub.publish(rec("a", T0, false));
        hub.close();
        let (first, second, third) = task.await.unwrap();
        assert!(matches!(first, Delivery::Lost(1)), "{first:?}");
        assert!(matches!(second, Delivery::Record(_)), "{second:?}");
        assert!(matches!(third, Delivery::Closed), "{third:?}");
    }

    #[tokio::test]
    async fn close_drains_then_closed() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let mut sub = hub.subscribe(all());
        hub.publish(rec("a", T0, false));
        hub.publish(rec("a", T0 + 1, false));
        hub.close();
        hub.publish(rec("a", T0 + 2, false));
        assert!(matches!(sub.next().await, Delivery::Record(r) if r.time_unix_ns == T0));
        assert!(matches!(sub.next().await, Delivery::Record(r) if r.time_unix_ns == T0 + 1));
        assert!(matches!(sub.next().await, Delivery::Closed));
        assert!(matches!(sub.next().await, Delivery::Closed));
        let mut late = hub.subscribe(all());
        assert!(matches!(late.next().await, Delivery::Closed));
        assert_eq!(hub.subscriber_count(), 0);
        // Dropping the hub closes too.
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let mut sub = hub.subscribe(all());
        drop(hub);
        assert!(matches!(sub.next().await, Delivery::Closed));
    }

    #[test]
    fn dropped_subscriptions_are_unregistered() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Off);
        let a = hub.subscribe(all());
        let b = hub.subscribe(only("x"));
        let c = hub.subscribe(all());
        assert_eq!(hub.subscriber_count(), 3);
        drop(a);
        drop(c);
        assert_eq!(hub.subscriber_count(), 1);
        hub.publish(rec("x", T0, false));
        drop(b);
        assert_eq!(hub.subscriber_count(), 0);
    }

    #[test]
    fn journal_rate_limit_per_sandbox() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::All);
        let t = Instant::now();
        let now = at(t, T0);
        for i in 0..10_000 {
            hub.publish_at(rec("flood", T0 + i, false), now);
        }
        assert_eq!(hub.journal_counts(), (100, 0));
        assert_eq!(hub.stats_of("flood").journal_suppressed, 9_900);
        for i in 0..50 {
            hub.publish_at(rec("quiet", T0 + i, false), now);
        }
        assert_eq!(hub.journal_counts(), (150, 0));
        assert_eq!(hub.stats_of("quiet").journal_suppressed, 0);
        hub.tick_at(now);
        assert_eq!(hub.journal_counts(), (150, 1));
        hub.tick_at(now);
        assert_eq!(
            hub.journal_counts(),
            (150, 1),
            "one summary per suppression"
        );
        // One second later the flooder has 20 more.
        let later = at(t + Duration::from_secs(1), T0 + 1_000_000_000);
        for i in 0..1000 {
            hub.publish_at(rec("flood", T0 + 1_000_000_000 + i, false), later);
        }
        assert_eq!(hub.journal_counts(), (170, 1));
        assert_eq!(hub.stats_of("flood").journal_suppressed, 9_900 + 980);
        hub.tick_at(later);
        assert_eq!(hub.journal_counts(), (170, 2));
    }

    #[test]
    fn journal_level_decides_what_is_written() {
        let hub = FlowHub::new(limits(512, 65_536, 4096), FlowLog::Denied);
        assert_eq!(hub.journal(), FlowLog::Denied);
        let now = at(Instant::now(), T0);
        hub.publish_at(rec("a", T0, false), now);
        hub.publish_at(rec("a", T0, true), now);
        assert_eq!(hub.journal_counts(), (1, 0));
        hub.set_journal(FlowLog::Off);
        assert_eq!(hub.journal(), FlowLog::Off);
        hub.publish_at(rec("a", T0, true), now);
        assert_eq!(hub.journal_counts(), (1, 0));
        hub.set_journal(FlowLog::All);
        hub.publish_at(rec("a", T0, false), now);
        let mut end = rec("a", T0, false);
        end.event = FlowEvent::End;
        end.end = Some(Totals {
            bytes_out: 10,
            packets_out: 1,
            bytes_in: 20,
            packets_in: 2,
            duration_ms: 5,
        });
        hub.publish_at(end, now);
        assert_eq!(hub.journal_counts(), (3, 0));
        assert_eq!(hub.stats_of("a").journal_suppressed, 0);
        assert_eq!(hub.stats_of("a").records, 5);
    }
}
