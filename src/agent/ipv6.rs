//! The node's IPv6 egress, followed live (docs/dual-stack.md "No IPv6
//! egress on the node"), and the Router Advertisements that tell guests:
//! when the uplink gains or loses its NAT66 address or its IPv6 default
//! route, the datapath, the resolver (AAAA or NODATA) and every guest (an
//! RA with or without the default route) follow within a moment; every
//! [`RA_INTERVAL`] each guest gets its RA again.

use tracing::{debug, info, warn};

use super::{Agent, NetworkView, Uplink, off_worker};
use crate::datapath::ra::{self, RA_INTERVAL};

impl Agent {
    /// Whether guests have the datapath's IPv6 link (config `ipv6`, on the
    /// eBPF datapath: nothing else answers their solicitations).
    pub(super) fn ipv6_link(&self) -> bool {
        self.cfg.ipv6 == crate::config::Ipv6Mode::Auto
            && self.cfg.datapath == crate::config::DatapathKind::Ebpf
    }

    /// Reads the uplink's NAT66 address again; on a change the datapath,
    /// then the resolver, then every guest follow (in that order: a guest
    /// told of a default route finds NAT66 on; one whose route is
    /// withdrawn has its IPv6 refused at once already).
    pub(super) async fn follow_uplink6(&self) {
        let Uplink::Found {
            ifindex,
            addr: Some(_),
            ..
        } = &self.uplink
        else {
            return;
        };
        if !self.ipv6_link() {
            return;
        }
        let now = match self.nl.ipv6_egress_addr(*ifindex).await {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %crate::error_chain(&e), "reading the uplink's IPv6 addresses again");
                return;
            }
        };
        let before = self.uplink6();
        if now == before {
            return;
        }
        if let Err(e) = self.datapath.set_uplink6(now) {
            warn!(error = %e, ipv6 = ?now, "the uplink's IPv6 address changed; the datapath keeps the old one");
            return;
        }
        *self.uplink6.write().unwrap_or_else(|p| p.into_inner()) = now;
        info!(before = ?before, now = ?now, "the uplink's IPv6 egress changed");
        let sent = self.advertise(self.list()).await;
        info!(sent, "router advertisements sent to {sent} sandboxes");
    }

    /// Why `rec`'s IPv6 does not reach the world, and what opens it
    /// (GetNetwork's `ipv6_egress_reason`): the node's uplink first (no
    /// rule can open what the node lacks), then the sandbox's rules
    /// (`types::ipv6_closed_why`, the one rule for `ipv6_egress`). None
    /// when it does.
    pub(super) fn ipv6_egress_why(
        &self,
        rec: &crate::agent::spec::NetworkRecord,
    ) -> Option<String> {
        let rules =
            crate::types::ipv6_closed_why(rec.allow_internet_access, &rec.allow_out, &rec.deny_out);
        if self.ipv6_egress() {
            return rules.map(str::to_owned);
        }
        let node = match &self.uplink {
            Uplink::Found {
                name,
                addr: Some(_),
                ..
            } => format!(
                "the node has no IPv6 egress: its uplink {name} has no usable global IPv6 \
                 address with an IPv6 default route through it; give it both and every \
                 sandbox's IPv6 follows within a moment (docs/dual-stack.md \"How to\")"
            ),
            Uplink::Found {
                name, addr: None, ..
            } => {
                format!("the node has no egress: its uplink {name} has no IPv4 address")
            }
            Uplink::Missing(why) => format!("the node has no egress: {why}"),
        };
        Some(match rules {
            Some(r) => format!("{node}; then: {r}"),
            None => node,
        })
    }

    /// Whether `view`'s RAs carry the default route (its IPv6 reaches the
    /// world).
    fn ra_router(&self, view: &NetworkView) -> bool {
        self.ipv6_egress() && view.record.ipv6_open()
    }

    /// An RA to each of `views`' devices (on a node with the guests' IPv6
    /// link); how many were sent. A device that cannot take one (down,
    /// gone) is skipped.
    pub(super) async fn advertise(&self, views: Vec<NetworkView>) -> usize {
        if !self.ipv6_link() {
            return 0;
        }
        let frames: Vec<(u32, Vec<u8>)> = views
            .iter()
            .filter(|v| v.tap_ifindex != 0)
            .map(|v| {
                let f = ra::frame(
                    self.d.gateway_mac,
                    self.d.guest_mac,
                    self.ra_router(v),
                    self.gateway.pool6,
                );
                (v.tap_ifindex, f)
            })
            .collect();
        off_worker(move || {
            let sender = match ra::Sender::new() {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "a packet socket for router advertisements");
                    return 0;
                }
            };
            frames
                .iter()
                .filter(|(ifindex, f)| match sender.send(*ifindex, f) {
                    Ok(()) => true,
                    Err(e) => {
                        debug!(ifindex, error = %e, "router advertisement not sent");
                        false
                    }
                })
                .count()
        })
        .await
    }

    /// The uplink's IPv6 followed (`changes`: a poke per kernel
    /// notification, see `netlink::watch_ipv6_addrs_and_routes`), and
    /// every guest's RA repeated every [`RA_INTERVAL`].
    pub(super) async fn run_ipv6(
        self: std::sync::Arc<Self>,
        mut changes: tokio::sync::mpsc::UnboundedReceiver<()>,
    ) {
        let weak = std::sync::Arc::downgrade(&self);
        drop(self);
        let mut tick = tokio::time::interval(RA_INTERVAL);
        tick.tick().await;
        // A change between the first read at start and the subscription
        // would otherwise go unseen.
        if let Some(agent) = weak.upgrade() {
            agent.follow_uplink6().await;
        }
        loop {
            tokio::select! {
                poke = changes.recv() => {
                    if poke.is_none() {
                        return;
                    }
                    // A change comes as several notifications (an address,
                    // its route, DAD done): read the state once they
                    // settle.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    while changes.try_recv().is_ok() {}
                    let Some(agent) = weak.upgrade() else { return };
                    agent.follow_uplink6().await;
                }
                _ = tick.tick() => {
                    // Read again too (a lost notification, a failed dump).
                    let Some(agent) = weak.upgrade() else { return };
                    agent.follow_uplink6().await;
                    agent.advertise(agent.list()).await;
                }
            }
        }
    }

    /// A network whose RA changes (its IPv6 opened or closed by a
    /// converge) gets the new one at once.
    pub(super) fn readvertise_if_changed(&self, old: Option<&NetworkView>, new: &NetworkView) {
        let Some(old) = old.filter(|o| o.tap_ifindex == new.tap_ifindex && new.tap_ifindex != 0)
        else {
            return;
        };
        if !self.ipv6_link() || old.record.ipv6_open() == new.record.ipv6_open() {
            return;
        }
        let f = ra::frame(
            self.d.gateway_mac,
            self.d.guest_mac,
            self.ra_router(new),
            self.gateway.pool6,
        );
        if let Err(e) = ra::Sender::new().and_then(|s| s.send(new.tap_ifindex, &f)) {
            debug!(ifindex = new.tap_ifindex, error = %e, "router advertisement not sent");
        }
    }
}
