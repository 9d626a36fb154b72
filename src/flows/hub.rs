//! See mod.rs. API skeleton: the implementation is being written.

use std::sync::Arc;

use super::record::FlowRecord;

pub use crate::config::FlowLog;

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

pub struct FlowHub {}

pub struct Subscription {}

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

impl FlowHub {
    /// A hub writing `journal` records to the journal.
    pub fn new(_limits: HubLimits, _journal: FlowLog) -> Arc<FlowHub> {
        todo!()
    }

    /// One record: into the history, to every subscriber whose filter
    /// takes it (a full queue: the subscriber loses it, counted), to the
    /// journal if `flow_log` takes it and the sandbox's journal budget
    /// allows. Never waits for a subscriber.
    pub fn publish(&self, _rec: FlowRecord) {
        todo!()
    }

    /// The datapath did not emit `n` of the sandbox's events (its bucket
    /// was empty or the ring full): counted, and subscribers whose filter
    /// takes the sandbox are told (`Delivery::Lost`).
    pub fn note_lost(&self, _sandbox_id: &str, _n: u64) {
        todo!()
    }

    /// Records published from now on that `filter` takes.
    pub fn subscribe(&self, _filter: Filter) -> Subscription {
        todo!()
    }

    /// The kept records `filter` takes with `time_unix_ns >= since`, oldest
    /// first.
    pub fn history(&self, _filter: &Filter, _since_unix_ns: u64) -> Vec<Arc<FlowRecord>> {
        todo!()
    }

    /// Every sandbox's counters (metrics).
    pub fn stats(&self) -> Vec<(String, SandboxFlowStats)> {
        todo!()
    }

    /// One sandbox's counters.
    pub fn stats_of(&self, _sandbox_id: &str) -> SandboxFlowStats {
        todo!()
    }

    /// Writes the journal's "N suppressed" summaries of sandboxes whose
    /// records were suppressed since the last call; the agent calls it
    /// every second.
    pub fn tick(&self) {
        todo!()
    }

    /// The journal level now.
    pub fn journal(&self) -> FlowLog {
        todo!()
    }

    /// Ends every subscription (`Delivery::Closed`).
    pub fn close(&self) {
        todo!()
    }
}

impl Subscription {
    /// The next record, loss report or the end.
    pub async fn next(&mut self) -> Delivery {
        todo!()
    }
}
