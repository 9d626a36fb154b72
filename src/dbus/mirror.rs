//! The bus mirror: follows the core's event stream and keeps the bus in
//! step with it — one object per network (InterfacesAdded/Removed through
//! the ObjectManager), NetworkEnsured/NetworkReleased, PropertiesChanged on
//! network objects and on the manager — whichever edge (D-Bus, varlink,
//! Reconcile, the pool) made the change. No polling: the manager's
//! properties are re-read when a batch of events says node facts may have
//! changed, and Health at most once per [`HEALTH_EVERY`].

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tracing::{debug, warn};
use zbus::Connection;
use zbus::names::InterfaceName;
use zbus::zvariant::Value;

use super::{BUS_NAME, MANAGER_PATH, Manager, NetworkObject, network_path};
use crate::agent::events::{Change, Event};
use crate::agent::{Agent, NetworkView};

/// Health is a full evaluation (datapath counters, kernel checks of
/// drifted filters): not more often than this.
const HEALTH_EVERY: Duration = Duration::from_millis(500);
/// The manager's counters (ActiveNetworks, IdleTaps, FreeAddresses) are
/// signalled at most this often.
const NODE_EVERY: Duration = Duration::from_millis(100);

/// A manager signal an event calls for.
enum Signal {
    Ensured(String, super::Dict),
    Released(String),
    TrafficWhilePaused(String, super::Dict),
}

/// A network's object as registered: reads of it need the read action.
type Gated = super::gate::ReadGate<NetworkObject>;

pub struct Mirror {
    conn: Connection,
    authority: crate::auth::Authority,
    agent: Arc<Agent>,
    /// Sequence number of the last event applied, for method replies.
    done: watch::Sender<u64>,
    /// The sandbox ids that have an object on the bus (each object holds
    /// the view it shows; no second copy here).
    objects: HashSet<String>,
    /// Manager properties as last signalled.
    counters: (u32, u32, u32),
    healthy: Option<bool>,
}

impl Mirror {
    pub fn new(
        conn: Connection,
        agent: Arc<Agent>,
        done: watch::Sender<u64>,
        authority: crate::auth::Authority,
    ) -> Self {
        let counters = counters(&agent);
        Self {
            conn,
            authority,
            agent,
            done,
            objects: HashSet::new(),
            counters,
            healthy: None,
        }
    }

    /// Registers an object per network (at start, before the name is
    /// taken); returns how many.
    pub async fn register_all(&mut self, views: Vec<NetworkView>) -> zbus::Result<usize> {
        for view in views {
            self.put(view).await?;
        }
        Ok(self.objects.len())
    }

    /// Creates or updates a network's object. `None` if it was new, else
    /// the keys of the network dictionary that changed (their properties
    /// are signalled).
    async fn put(&mut self, view: NetworkView) -> zbus::Result<Option<Vec<&'static str>>> {
        let id = view.record.sandbox_id.clone();
        let path = network_path(&id);
        let server = self.conn.object_server();
        if self.objects.insert(id) {
            let object = Gated::properties(NetworkObject { view }, self.authority.clone());
            server.at(&path, object).await?;
            return Ok(None);
        }
        let iface = server.interface::<_, Gated>(&path).await?;
        let old = std::mem::replace(&mut iface.get_mut().await.inner.view, view.clone());
        let changed = changed_keys(&old, &view);
        if changed.is_empty() {
            return Ok(Some(changed));
        }
        let gated = iface.get().await;
        let obj = &gated.inner;
        let e = iface.signal_emitter();
        for key in &changed {
            match *key {
                "tap_ifindex" => obj.tap_ifindex_changed(e).await?,
                "tap_name" => obj.tap_name_changed(e).await?,
                "network_handle" => obj.network_handle_changed(e).await?,
                "sandbox_ip" => obj.sandbox_ip_changed(e).await?,
                "mtu" => obj.mtu_changed(e).await?,
                "port_mappings" => obj.port_mappings_changed(e).await?,
                "allow_internet_access" => obj.allow_internet_access_changed(e).await?,
                "allow_out" => obj.allow_out_changed(e).await?,
                "deny_out" => obj.deny_out_changed(e).await?,
                _ => {}
            }
        }
        Ok(Some(changed))
    }

    async fn remove(&mut self, id: &str) -> zbus::Result<()> {
        if self.objects.remove(id) {
            self.conn
                .object_server()
                .remove::<Gated, _>(network_path(id))
                .await?;
        }
        Ok(())
    }

    /// Applies an event to the objects (the object exists, has its new
    /// properties, or is gone: what a method reply waits for) and returns
    /// the manager signal it calls for, to be sent after `done` moved on,
    /// so the caller's reply does not wait for it.
    async fn apply(&mut self, ev: &Event) -> zbus::Result<Option<Signal>> {
        Ok(match &ev.change {
            Change::Ensured { view, .. } => {
                let changed = self.put(view.clone()).await?;
                let dict = ensured_dict(view, changed.as_deref());
                Some(Signal::Ensured(view.record.sandbox_id.clone(), dict))
            }
            Change::Repaired { view, .. } => {
                self.put(view.clone()).await?;
                None
            }
            Change::Released { sandbox_id } => {
                self.remove(sandbox_id).await?;
                Some(Signal::Released(sandbox_id.clone()))
            }
            Change::Node => None,
            Change::TrafficWhilePaused {
                sandbox_id,
                traffic,
            } => Some(Signal::TrafficWhilePaused(
                sandbox_id.clone(),
                super::paused_traffic_dict(traffic),
            )),
        })
    }

    async fn emit(&self, signal: Signal) -> zbus::Result<()> {
        let emitter = zbus::object_server::SignalEmitter::new(&self.conn, MANAGER_PATH)?;
        match signal {
            Signal::Ensured(id, dict) => Manager::network_ensured(&emitter, &id, dict).await,
            Signal::Released(id) => Manager::network_released(&emitter, &id).await,
            Signal::TrafficWhilePaused(id, dict) => {
                Manager::traffic_while_paused(&emitter, &id, dict).await
            }
        }
    }

    /// After falling behind the stream: make the objects equal the core's
    /// current views (signals of the missed events are lost; objects and
    /// properties are right again).
    async fn resync(&mut self) {
        let at = self.agent.events_seen();
        let views = self.agent.list();
        let live: std::collections::HashSet<String> =
            views.iter().map(|v| v.record.sandbox_id.clone()).collect();
        let gone: Vec<String> = self
            .objects
            .iter()
            .filter(|id| !live.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Err(e) = self.remove(&id).await {
                warn!(sandbox_id = id, error = %e, "removing a network object failed");
            }
        }
        for view in views {
            if let Err(e) = self.put(view).await {
                warn!(error = %e, "registering a network object failed");
            }
        }
        self.done.send_replace(at);
    }

    /// Signals the manager properties that changed since last time.
    async fn node(&mut self, health: bool) {
        let Ok(e) = zbus::object_server::SignalEmitter::new(&self.conn, MANAGER_PATH) else {
            return;
        };
        let now = counters(&self.agent);
        let last = std::mem::replace(&mut self.counters, now);
        // One PropertiesChanged carrying every property that changed (the
        // generated `*_changed` would send one signal each).
        let mut changed: HashMap<&str, Value<'_>> = HashMap::new();
        if now.0 != last.0 {
            changed.insert("ActiveNetworks", Value::from(now.0));
        }
        if now.1 != last.1 {
            changed.insert("IdleTaps", Value::from(now.1));
        }
        if now.2 != last.2 {
            changed.insert("FreeAddresses", Value::from(now.2));
        }
        if health {
            let healthy = self.agent.health().await.0;
            if self.healthy.replace(healthy).is_some_and(|h| h != healthy) {
                changed.insert("Healthy", Value::from(healthy));
            }
        }
        if !changed.is_empty()
            && let Ok(name) = InterfaceName::try_from(BUS_NAME)
        {
            let _ =
                zbus::fdo::Properties::properties_changed(&e, name, changed, Cow::Borrowed(&[]))
                    .await;
        }
    }

    /// Applies events in batches until the agent goes away.
    pub async fn run(mut self, mut rx: broadcast::Receiver<Arc<Event>>) {
        self.healthy = Some(self.agent.health().await.0);
        let mut last_health = Instant::now();
        let mut health_due: Option<Instant> = None;
        let mut last_node = Instant::now();
        let mut node_due: Option<Instant> = None;
        loop {
            let first = tokio::select! {
                got = rx.recv() => got,
                _ = sleep_until(health_due) => {
                    health_due = None;
                    last_health = Instant::now();
                    node_due = None;
                    last_node = Instant::now();
                    self.node(true).await;
                    continue;
                }
                _ = sleep_until(node_due) => {
                    node_due = None;
                    last_node = Instant::now();
                    self.node(false).await;
                    continue;
                }
            };
            let mut batch = match first {
                Ok(ev) => vec![ev],
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    warn!(
                        missed = n,
                        "the bus mirror fell behind the event stream; resyncing"
                    );
                    self.resync().await;
                    self.node(false).await;
                    health_due = Some(Instant::now());
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            let mut lagged = false;
            loop {
                match rx.try_recv() {
                    Ok(ev) => batch.push(ev),
                    Err(broadcast::error::TryRecvError::Lagged(_)) => {
                        lagged = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            let mut node = false;
            for ev in &batch {
                node |= !matches!(
                    ev.change,
                    Change::Repaired { .. } | Change::TrafficWhilePaused { .. }
                );
                let signal = match self.apply(ev).await {
                    Ok(signal) => signal,
                    Err(e) => {
                        warn!(seq = ev.seq, kind = ev.change.kind(), error = %e, "mirroring an event on the bus failed");
                        None
                    }
                };
                // The reply may go now; NetworkEnsured/Released follow it.
                self.done.send_replace(ev.seq);
                if let Some(signal) = signal
                    && let Err(e) = self.emit(signal).await
                {
                    warn!(seq = ev.seq, error = %e, "emitting a signal failed");
                }
            }
            debug!(events = batch.len(), "events mirrored on the bus");
            if lagged {
                self.resync().await;
            }
            if node {
                // The manager's counters at most every NODE_EVERY: under
                // load one PropertiesChanged covers many calls.
                if node_due.is_none() {
                    node_due = Some((last_node + NODE_EVERY).max(Instant::now()));
                }
                if health_due.is_none() {
                    health_due = Some((last_health + HEALTH_EVERY).max(Instant::now()));
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The keys of the network dictionary (see `network_dict`) whose values
/// differ between two views of one network.
fn changed_keys(a: &NetworkView, b: &NetworkView) -> Vec<&'static str> {
    let (r, s) = (&a.record, &b.record);
    [
        ("tap_ifindex", a.tap_ifindex != b.tap_ifindex),
        ("tap_name", r.tap_name != s.tap_name),
        ("network_handle", r.network_handle != s.network_handle),
        ("sandbox_ip", r.sandbox_ip != s.sandbox_ip),
        ("mtu", r.mtu != s.mtu),
        ("port_mappings", r.port_mappings != s.port_mappings),
        (
            "allow_internet_access",
            r.allow_internet_access != s.allow_internet_access,
        ),
        ("allow_out", r.allow_out != s.allow_out),
        ("deny_out", r.deny_out != s.deny_out),
        ("metadata", r.metadata != s.metadata),
        ("idempotency_key", r.idempotency_key != s.idempotency_key),
    ]
    .into_iter()
    .filter_map(|(k, differs)| differs.then_some(k))
    .collect()
}

/// NetworkEnsured's dictionary: what happened and who the network is, not
/// the whole network (InterfacesAdded carries the new object's properties
/// and PropertiesChanged the changed ones; GetNetwork has everything).
/// `changed` is `None` for a new network.
fn ensured_dict(view: &NetworkView, changed: Option<&[&str]>) -> super::Dict {
    let r = &view.record;
    let mut d = super::Dict::new();
    let mut put = |k: &str, v: Value<'_>| {
        d.insert(
            k.to_owned(),
            v.try_to_owned().expect("no fds in a NetworkEnsured dict"),
        );
    };
    put(
        "change",
        Value::from(if changed.is_none() {
            "created"
        } else {
            "updated"
        }),
    );
    put("network_handle", Value::from(r.network_handle.as_str()));
    put("tap_name", Value::from(r.tap_name.as_str()));
    put("tap_ifindex", Value::from(view.tap_ifindex as i32));
    put("sandbox_ip", Value::from(r.sandbox_ip.to_string()));
    if let Some(keys) = changed {
        put("changed", Value::from(keys.to_vec()));
    }
    d
}

fn counters(agent: &Agent) -> (u32, u32, u32) {
    (
        agent.active_networks(),
        agent.idle_taps(),
        agent.free_addresses(),
    )
}
