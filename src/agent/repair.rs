//! Drift and its repair: ReconcileNetwork, the garbage collection of
//! leftovers nobody owns, the kernel's tc removal notifications, and the
//! one repair ladder that recovery shares (missing TAP -> MTU/up ->
//! neighbour -> datapath filter and entries -> the TAP fd).

use std::net::{IpAddr, Ipv4Addr};

use tracing::info;

use super::events::Change;
use super::spec::{self, validate_sandbox_id};
use super::{Agent, AgentError, Network, ReconcileReport, failed};
use crate::datapath::Hook;
use crate::netlink::{LinkChange, LinkInfo};

impl Agent {
    /// The kernel announced a qdisc or filter removal on `r.ifindex`. Only
    /// the kinds the datapath uses matter (the host's own tc use of other
    /// kinds costs nothing here).
    pub(super) fn note_tc_removal(&self, r: crate::netlink::TcRemoval) {
        if !matches!(r.what.as_str(), "qdisc clsact" | "filter bpf") {
            return;
        }
        self.datapath.forget_attachment(r.ifindex);
        self.drift
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(r.ifindex, r.what);
        self.events.publish(Change::Node);
    }

    /// Compares the kernel with one hook the datapath keeps and attaches it
    /// again when the kernel lost it (or runs another program there).
    /// `Some(why)` if it had to.
    pub(super) async fn repair_hook(&self, hook: &Hook) -> Result<Option<String>, String> {
        let (dp, owned) = (self.datapath.clone(), hook.clone());
        let drift = super::off_worker(move || {
            let drift = dp.check(std::slice::from_ref(&owned))?;
            if let Some((_, why)) = drift.into_iter().next() {
                dp.reattach(&owned)?;
                return Ok(Some(why));
            }
            Ok(None)
        })
        .await
        .map_err(|e: crate::datapath::DatapathError| format!("{hook}: {e}"))?;
        self.drift
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&hook.ifindex);
        Ok(drift)
    }

    /// The kernel check of a network's TAP filter; a repair message if it
    /// had to re-attach it.
    pub(super) async fn repair_tap_hook(&self, net: &Network) -> Result<Option<String>, String> {
        let Some(hook) = self.datapath.tap_hook(&net.rec.tap_name, net.ifindex) else {
            return Ok(None);
        };
        // A bound TAP runs what the shared block runs: that too.
        if matches!(hook.place, crate::datapath::Place::Bound(_))
            && let Some(block) = self
                .datapath
                .node_hooks()
                .into_iter()
                .find(|h| matches!(h.place, crate::datapath::Place::Block(_)))
            && let Some(why) = self.repair_hook(&block).await?
        {
            return Ok(Some(format!("node: {block}: {why}; attached again")));
        }
        Ok(self
            .repair_hook(&hook)
            .await?
            .map(|why| format!("{}: {hook}: {why}; attached again", net.rec.sandbox_id)))
    }

    /// ReconcileNetwork: re-checks one network ("" = all, plus the node's
    /// datapath hooks, orphan TAPs and stale neighbours) against the kernel
    /// and repairs drift. Each network is checked inside its slot with
    /// facts read there, so an ensure or release in flight is never judged
    /// from a stale snapshot: a network that was released and created
    /// again since the list was taken (another handle) is left alone.
    pub async fn reconcile(&self, id: &str) -> Result<ReconcileReport, AgentError> {
        let mut report = ReconcileReport::default();
        let wanted: Vec<(String, String)> = if id.is_empty() {
            let views = self.views.read().unwrap_or_else(|p| p.into_inner());
            views
                .values()
                .map(|v| (v.record.sandbox_id.clone(), v.record.network_handle.clone()))
                .collect()
        } else {
            validate_sandbox_id(id)?;
            let v = self.get(id)?;
            vec![(id.to_owned(), v.record.network_handle)]
        };
        // After the list: every listed network's neighbour was installed
        // before this dump, and only its own slot changes it.
        let neighbours = self
            .nl
            .neigh_list(self.gateway.ifindex)
            .await
            .map_err(|e| failed("listing neighbours", &e))?;
        for (id, handle) in &wanted {
            let slot = self.slot(id);
            {
                let mut guard = slot.lock().await;
                if let Some(net) = guard.as_mut().filter(|n| &n.rec.network_handle == handle) {
                    report.checked += 1;
                    let link = self
                        .nl
                        .link_by_name(&net.rec.tap_name)
                        .await
                        .map_err(|e| failed("looking up the TAP", &e));
                    match link {
                        Err(e) => report.errors.push(format!("{id}: {e}")),
                        Ok(link) => {
                            let neighbour_ok = neighbours.iter().any(|(ip, mac, _)| {
                                *ip == net.rec.sandbox_ip && *mac == Some(self.d.guest_mac)
                            });
                            let done = self.repair_ladder(net, link, neighbour_ok, true).await;
                            report.errors.extend(done.errors);
                            if let Some(gone) = done.gone {
                                // Health's `veths` check reads the view.
                                self.set_view(net);
                                report.errors.push(gone);
                            }
                            if !done.repairs.is_empty() {
                                self.set_view(net);
                                self.events.publish(Change::Repaired {
                                    view: net.view(),
                                    repairs: done.repairs.clone(),
                                });
                                report.repaired.extend(done.repairs);
                            }
                        }
                    }
                }
            }
            self.forget_slot(id, slot);
        }
        if id.is_empty() {
            for hook in self.datapath.node_hooks() {
                match self.repair_hook(&hook).await {
                    Ok(Some(why)) => report
                        .repaired
                        .push(format!("node: {hook}: {why}; attached again")),
                    Ok(None) => {}
                    Err(e) => report.errors.push(format!("node: {e}")),
                }
            }
            let links = self
                .nl
                .list_links()
                .await
                .map_err(|e| failed("listing links", &e))?;
            self.collect_garbage(&links, &neighbours, &mut report).await;
        }
        if !report.repaired.is_empty() || !report.removed.is_empty() {
            self.events.publish(Change::Node);
        }
        info!(
            checked = report.checked,
            repaired = report.repaired.len(),
            removed = report.removed.len(),
            errors = report.errors.len(),
            "reconciled"
        );
        Ok(report)
    }

    /// The one repair ladder, shared by recovery and Reconcile, run with
    /// the network's slot held: missing TAP -> MTU/up -> neighbour ->
    /// datapath filter (checked in the kernel) and entries -> the agent's
    /// TAP fd. `link` is the kernel's TAP of that name (None: gone).
    /// `check_filter`: ask the kernel for the TAP's filter here (recovery
    /// asks for all TAPs at once afterwards, in parallel).
    pub(super) async fn repair_ladder(
        &self,
        net: &mut Network,
        link: Option<LinkInfo>,
        neighbour_ok: bool,
        check_filter: bool,
    ) -> Ladder {
        let id = net.rec.sandbox_id.clone();
        let mut out = Ladder::default();
        match link {
            None if !net.rec.attach.is_tap() => {
                // A veth cannot be made again: its peer lived in the
                // container's namespace, which the agent cannot reach any
                // more (deleted with the container, most likely). The
                // address stays reserved until ReleaseNetwork (CNI DEL/GC).
                net.ifindex = 0;
                out.gone = Some(format!(
                    "{id}: veth {} is gone (its container's network namespace was deleted?); \
                     ReleaseNetwork (CNI DEL or GC) frees the network",
                    net.rec.tap_name
                ));
            }
            None => {
                // The TAP vanished (deleted by hand): make a new one.
                if net.tap.take().is_some() && net.ifindex != 0 {
                    crate::systemd::remove_tap_fd(net.ifindex);
                }
                match self.cold_tap(&net.rec.tap_name, net.rec.mtu).await {
                    Ok(pt) => {
                        net.ifindex = pt.ifindex;
                        net.tap = Some(pt.tap);
                        // A new device: only the agent has it.
                        net.handed_out = false;
                        out.repairs.push(format!(
                            "{id}: TAP {} was missing, recreated",
                            net.rec.tap_name
                        ));
                    }
                    Err(e) => out.errors.push(format!("{id}: {e}")),
                }
            }
            Some(link) => {
                net.ifindex = link.index;
                if !link.up || link.mtu != net.rec.mtu {
                    let change = LinkChange {
                        mtu: Some(net.rec.mtu),
                        up: Some(true),
                        ..Default::default()
                    };
                    match self.nl.set_link(link.index, change).await {
                        Ok(()) => out.repairs.push(format!(
                            "{id}: TAP {} was {} with MTU {}, set up with MTU {}",
                            net.rec.tap_name,
                            if link.up { "up" } else { "down" },
                            link.mtu,
                            net.rec.mtu
                        )),
                        Err(e) => out.errors.push(format!("{id}: {}", crate::error_chain(&e))),
                    }
                }
            }
        }
        if !neighbour_ok {
            match self
                .nl
                .neigh_replace_permanent(self.gateway.ifindex, net.rec.sandbox_ip, self.d.guest_mac)
                .await
            {
                Ok(()) => out.repairs.push(format!(
                    "{id}: neighbour entry for {} restored",
                    net.rec.sandbox_ip
                )),
                Err(e) => out.errors.push(format!("{id}: {}", crate::error_chain(&e))),
            }
        }
        if net.ifindex != 0 {
            // The kernel check first: `attach` alone would quietly put back
            // a filter the tc watcher reported removed, unreported.
            if check_filter {
                match self.repair_tap_hook(net).await {
                    Ok(Some(what)) => out.repairs.push(what),
                    Ok(None) => {}
                    Err(e) => out.errors.push(format!("{id}: {e}")),
                }
            }
            if let Err(e) = self.dp_attach(net).await {
                out.errors.push(format!("{id}: {e}"));
            }
        }
        // A TAP adopted without an fd: take it back if its holder let go
        // (still held is not an error: the VMM is running).
        match self.reattach_fd(net).await {
            Ok(true) => out.repairs.push(format!(
                "{id}: TAP {} re-attached (adopted without an fd, its holder let go)",
                net.rec.tap_name
            )),
            Ok(false) | Err(AgentError::TapBusy { .. }) => {}
            Err(e) => out.errors.push(format!("{id}: {e}")),
        }
        out
    }

    /// Our TAPs and neighbour entries for pool addresses that nothing
    /// owns. The address allocator is the owner of record: an address is
    /// allocated from the start of a create (before its TAP is named or its
    /// neighbour added) until the end of a release. To make "unowned"
    /// atomic with the removal, the collector holds the address itself
    /// (reserves it in the allocator, so no create can take it and no
    /// release is in flight for it), looks at the kernel again, removes,
    /// and only then lets the address go.
    pub(super) async fn collect_garbage(
        &self,
        links: &[LinkInfo],
        neighbours: &[(IpAddr, Option<[u8; 6]>, u16)],
        report: &mut ReconcileReport,
    ) {
        let hold = |ip: Ipv4Addr| {
            self.d.pool.contains(ip)
                && ip != self.d.pool.gateway()
                && self.allocs().ips.reserve(ip).is_ok()
        };
        let let_go = |ip: Ipv4Addr| {
            self.allocs().ips.release(ip);
        };
        for link in links
            .iter()
            .filter(|l| matches!(l.kind.as_deref(), Some("tun" | "veth")))
        {
            let spec::TapNameKind::Sandbox(ip) =
                spec::classify_tap_name(&self.cfg.tap_prefix, &link.name)
            else {
                continue;
            };
            if !hold(ip) {
                continue;
            }
            // Still that TAP under that name (not renamed back to the pool
            // by a release that finished after the dump)?
            match self.nl.link_by_index(link.index).await {
                Ok(Some(now)) if now.name == link.name => {
                    match self.nl.delete_link(link.index).await {
                        Ok(()) => report.removed.push(format!(
                            "orphan {} {}",
                            if link.kind.as_deref() == Some("veth") {
                                "veth"
                            } else {
                                "TAP"
                            },
                            link.name
                        )),
                        Err(e) => report.errors.push(crate::error_chain(&e)),
                    }
                }
                Ok(_) => {}
                Err(e) => report.errors.push(crate::error_chain(&e)),
            }
            let_go(ip);
        }
        for (ip, _, _) in neighbours {
            let IpAddr::V4(v4) = ip else { continue };
            if !hold(*v4) {
                continue;
            }
            match self.nl.neigh_del(self.gateway.ifindex, *ip).await {
                Ok(true) => report.removed.push(format!("stale neighbour {ip}")),
                Ok(false) => {}
                Err(e) => report.errors.push(crate::error_chain(&e)),
            }
            let_go(*v4);
        }
    }
}

/// What one run of the repair ladder did.
#[derive(Debug, Default)]
pub(super) struct Ladder {
    pub repairs: Vec<String>,
    pub errors: Vec<String>,
    /// A veth whose pair is gone with its container's namespace: nothing
    /// to repair, the network waits for its release.
    pub gone: Option<String>,
}
