//! The core's ordered stream of changes. Every transition publishes here
//! from inside the per-sandbox critical section that made it, so for one
//! sandbox the events come in the order its state changed, and `seq` orders
//! all of them. The edges follow this stream (D-Bus objects, signals and
//! PropertiesChanged; varlink `WatchNetworks`); no edge derives a change
//! on its own, whichever edge caused it.

use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use super::NetworkView;

/// How many events a slow subscriber may fall behind before it is told it
/// lagged (it then re-reads the current state).
pub const BACKLOG: usize = 4096;

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// EnsureNetwork created (`created`) or changed a network.
    Ensured { view: NetworkView, created: bool },
    /// ReleaseNetwork removed a network.
    Released { sandbox_id: String },
    /// Reconcile repaired a network (what it did, one line per repair).
    Repaired {
        view: NetworkView,
        repairs: Vec<String>,
    },
    /// Node-wide facts may have changed: counters (networks, idle TAPs,
    /// free addresses) or Health (a filter removed, a TAP quarantined...).
    Node,
    /// The datapath dropped the first packet for a paused sandbox (one
    /// per pause): what arrived, so an orchestrator can resume its VM.
    TrafficWhilePaused {
        sandbox_id: String,
        traffic: PausedTraffic,
    },
}

/// What arrived for a paused sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PausedTraffic {
    /// "tcp", "udp" or "icmp".
    pub protocol: &'static str,
    /// The sandbox's port it was for (0 for ICMP).
    pub port: u16,
    /// Who sent it: a world address, or the node's own.
    /// Who sent it, of either family (an IPv6 world host, the node's own
    /// IPv6 identity, an IPv4 sender).
    pub remote_ip: std::net::IpAddr,
    pub remote_port: u16,
    /// "reply" (to a flow the sandbox opened), "port_mapping" (a flow to
    /// one of its mappings) or "host" (the node, to its address or a
    /// mapped port on the node).
    pub via: &'static str,
}

impl Change {
    /// The sandbox this change is about, if any.
    pub fn sandbox_id(&self) -> Option<&str> {
        match self {
            Change::Ensured { view, .. } | Change::Repaired { view, .. } => {
                Some(&view.record.sandbox_id)
            }
            Change::Released { sandbox_id } | Change::TrafficWhilePaused { sandbox_id, .. } => {
                Some(sandbox_id)
            }
            Change::Node => None,
        }
    }

    /// A short name for logs and the varlink stream.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::Ensured { created: true, .. } => "created",
            Change::Ensured { created: false, .. } => "updated",
            Change::Released { .. } => "released",
            Change::Repaired { .. } => "repaired",
            Change::Node => "node",
            Change::TrafficWhilePaused { .. } => "traffic_while_paused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// 1, 2, 3... in the order the changes happened.
    pub seq: u64,
    pub change: Change,
}

/// The publisher.
pub struct Events {
    tx: broadcast::Sender<Arc<Event>>,
    /// The last sequence number handed out; taken together with the send so
    /// the channel's order is the sequence order.
    seq: Mutex<u64>,
}

impl Default for Events {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(BACKLOG).0,
            seq: Mutex::new(0),
        }
    }
}

impl Events {
    /// Publishes `change`; returns its sequence number.
    pub fn publish(&self, change: Change) -> u64 {
        let mut seq = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        *seq += 1;
        // No subscriber is fine: nobody is listening yet.
        let _ = self.tx.send(Arc::new(Event { seq: *seq, change }));
        *seq
    }

    /// A subscription and the sequence number of the last event published
    /// before it (the subscriber sees every later one).
    pub fn subscribe(&self) -> (broadcast::Receiver<Arc<Event>>, u64) {
        let seq = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        (self.tx.subscribe(), *seq)
    }

    /// The last sequence number handed out.
    pub fn last(&self) -> u64 {
        *self.seq.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_from_the_subscription_on() {
        let e = Events::default();
        assert_eq!(e.publish(Change::Node), 1);
        let (mut rx, at) = e.subscribe();
        assert_eq!(at, 1);
        let s = e.publish(Change::Released {
            sandbox_id: "a".into(),
        });
        assert_eq!(s, 2);
        e.publish(Change::Node);
        let got: Vec<(u64, &'static str)> = (0..2)
            .map(|_| {
                let ev = rx.try_recv().unwrap();
                (ev.seq, ev.change.kind())
            })
            .collect();
        assert_eq!(got, vec![(2, "released"), (3, "node")]);
        assert!(rx.try_recv().is_err());
    }
}
