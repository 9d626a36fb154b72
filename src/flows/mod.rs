//! The flow log (docs/flows.md): every connection a sandbox makes or is
//! refused, as records an operator can watch and a platform can keep.
//!
//! - `record.rs`: the record (pure values).
//! - `hub.rs`: where records go once the agent has made them: the recent
//!   history (a bounded share per sandbox), the live subscribers (varlink
//!   `WatchFlows`, each with a bounded queue: a slow one loses records,
//!   counted, and is told; it never slows the publisher), the journal
//!   (`flow_log`, rate-limited per sandbox with "N suppressed" summaries)
//!   and the counters behind the metrics.
//!
//! The datapath's side (the ring, the per-sandbox token buckets) is in
//! `datapath/`; turning its events into records (sandbox ids, wall-clock
//! time, the DNS name) in `agent/flows.rs`.

pub mod hub;
pub mod record;

pub use hub::{Delivery, Filter, FlowHub, FlowLog, HubLimits, SandboxFlowStats, Subscription};
pub use record::{Direction, Endpoint, FlowEvent, FlowRecord, Reason, Totals};
