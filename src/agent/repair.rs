//! Drift and its repair: ReconcileNetwork, the garbage collection of
//! leftovers nobody owns, the kernel's tc removal notifications, and the
//! one repair ladder that recovery shares (missing TAP -> MTU/up ->
//! neighbour -> datapath filter and entries -> the TAP fd).

use std::net::{IpAddr, Ipv4Addr};

use tracing::{info, warn};

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
        self.kernel_checks.invalidate();
        self.events.publish(Change::Node);
    }

    /// The kernel announced a link change. For a live network's TAP or
    /// veth, judged inside the network's slot (an ensure or release in
    /// flight changes its own device: its result counts, not the event in
    /// between) against the kernel's state then: deleted or moved away,
    /// renamed, or down is a fault `sandbox_links` reports until Reconcile
    /// repairs it; back to normal clears it.
    pub(super) async fn note_link(&self, ev: crate::netlink::LinkEvent) {
        if ev.ifindex == crate::netlink::LinkEvent::LOST {
            // Announcements were lost: every sandbox device is looked at
            // in the kernel again, as if each had been announced gone.
            let owned: Vec<u32> = self
                .by_ifindex
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .keys()
                .copied()
                .collect();
            warn!(
                devices = owned.len(),
                "link announcements lost; checking every sandbox device"
            );
            for ifindex in owned {
                Box::pin(self.note_link(crate::netlink::LinkEvent { ifindex, now: None })).await;
            }
            return;
        }
        let owner = self
            .by_ifindex
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ev.ifindex)
            .cloned();
        let Some(id) = owner else {
            return;
        };
        let known = self
            .link_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&ev.ifindex);
        // The common case (our own ensure setting its TAP up): nothing to
        // verify, nothing to clear.
        let looks_fine = |l: &LinkInfo| l.up && self.by_name_matches(&id, ev.ifindex, &l.name);
        if !known && ev.now.as_ref().is_some_and(looks_fine) {
            return;
        }
        let slot = self.slot(&id);
        {
            let guard = slot.lock().await;
            let why = match guard.as_ref().filter(|n| n.ifindex == ev.ifindex) {
                None => None,
                Some(net) => {
                    let kind = if net.rec.attach.is_tap() {
                        "TAP"
                    } else {
                        "veth"
                    };
                    let name = &net.rec.tap_name;
                    match self.nl.link_by_index(ev.ifindex).await {
                        Ok(None) => Some(format!(
                            "{kind} {name} (ifindex {}) was deleted or moved to another network namespace",
                            ev.ifindex
                        )),
                        Ok(Some(l)) if l.name != *name => {
                            Some(format!("{kind} {name} was renamed to {}", l.name))
                        }
                        Ok(Some(l)) if !l.up => Some(format!("{kind} {name} was set down")),
                        Ok(Some(_)) => None,
                        Err(e) => {
                            warn!(ifindex = ev.ifindex, error = %crate::error_chain(&e), "checking a sandbox device after a link event failed");
                            None
                        }
                    }
                }
            };
            let mut faults = self.link_faults.lock().unwrap_or_else(|p| p.into_inner());
            let changed = match &why {
                Some(w) => faults
                    .insert(ev.ifindex, (id.clone(), w.clone()))
                    .is_none_or(|(_, old)| old != *w),
                None => faults.remove(&ev.ifindex).is_some(),
            };
            drop(faults);
            if changed {
                match &why {
                    Some(w) => warn!(
                        sandbox_id = id,
                        "{w} by someone else; Health reports it until ReconcileNetwork repairs it"
                    ),
                    None => info!(sandbox_id = id, "sandbox device is back to normal"),
                }
                self.events.publish(Change::Node);
            }
        }
        self.forget_slot(&id, slot);
    }

    /// Whether `name` is the recorded device name of `id`'s network on
    /// `ifindex` (from the readers' view).
    fn by_name_matches(&self, id: &str, ifindex: u32, name: &str) -> bool {
        self.views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .is_some_and(|v| v.tap_ifindex == ifindex && v.record.tap_name == name)
    }

    /// Forgets the link faults of `id` (its devices were just checked and
    /// repaired under its slot).
    fn clear_link_faults(&self, id: &str) {
        self.link_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, (owner, _)| owner != id);
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
    /// The gateway device set up again (up, its address, the route to the
    /// pool with the sandboxes' MTU) if someone changed it; one that is
    /// gone needs a restart (the datapath holds its ifindex).
    async fn repair_gateway(&self, report: &mut ReconcileReport) {
        let problems = self.gateway_problems().await;
        if problems.is_empty() {
            return;
        }
        let name = &self.cfg.gateway_device;
        let (gw, len) = (self.d.pool.gateway(), self.d.pool.prefix_len());
        let r = match self.nl.link_by_index(self.gateway.ifindex).await {
            Ok(Some(l)) if &l.name == name => async {
                let ifindex = self.gateway.ifindex;
                self.nl
                    .ensure_gateway_device_with_mtu(name, gw, len, None)
                    .await?;
                self.nl
                    .set_prefix_route_mtu(self.d.pool.network(), len, ifindex, gw, self.cfg.mtu)
                    .await?;
                if self.gateway.pool6 {
                    Self::pool6_setup(&self.nl, ifindex, &self.d, self.cfg.mtu).await?;
                }
                Ok::<(), crate::netlink::NetlinkError>(())
            }
            .await
            .map_err(|e| crate::error_chain(&e)),
            _ => Err(format!("{}: restart the agent", problems.join("; "))),
        };
        match r {
            Ok(()) => report
                .repaired
                .push(format!("gateway device {name}: {}", problems.join("; "))),
            Err(e) => report.errors.push(format!("gateway device {name}: {e}")),
        }
    }

    pub async fn reconcile(&self, id: &str) -> Result<ReconcileReport, AgentError> {
        let mut report = ReconcileReport::default();
        self.kernel_checks.invalidate();
        if id.is_empty() {
            self.repair_gateway(&mut report).await;
        }
        let wanted: Vec<(String, String)> = if id.is_empty() {
            let views = self.views.read().unwrap_or_else(|p| p.into_inner());
            views
                .values()
                .map(|v| (v.record.sandbox_id.clone(), v.record.network_handle.clone()))
                .collect()
        } else {
            validate_sandbox_id(id)?;
            let v = self.get(id)?;
            vec![(id.to_owned(), v.record.network_handle.clone())]
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
                    let mut renamed = None;
                    let link = match link {
                        // Renamed by someone else: its own name back (a
                        // running VMM keeps its fd: the same device).
                        Ok(None) if net.ifindex != 0 => match self.rename_back(net).await {
                            Ok(Some((l, why))) => {
                                renamed = Some(why);
                                Ok(Some(l))
                            }
                            Ok(None) => Ok(None),
                            Err(e) => Err(e),
                        },
                        other => other,
                    };
                    match link {
                        Err(e) => report.errors.push(format!("{id}: {e}")),
                        Ok(link) => {
                            let neighbour_ok = neighbours.iter().any(|(ip, mac, _)| {
                                *ip == net.rec.sandbox_ip && *mac == Some(self.d.guest_mac)
                            });
                            let mut done = self.repair_ladder(net, link, neighbour_ok, true).await;
                            done.repairs.splice(0..0, renamed);
                            report.errors.extend(done.errors.iter().cloned());
                            if done.errors.is_empty() {
                                self.clear_link_faults(id);
                            }
                            if let Some(gone) = done.gone {
                                // Health's `veths` check reads the view, the
                                // edges the event (the device's ifindex is 0).
                                self.set_view(net);
                                self.events.publish(Change::Repaired {
                                    view: net.view(),
                                    repairs: vec![gone.clone()],
                                });
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
        self.kernel_checks.invalidate();
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

    /// A network's device is not under its recorded name: if its ifindex
    /// still exists here under another one, it gets its name back (down,
    /// renamed; the ladder sets it up again). `None`: it is gone.
    async fn rename_back(&self, net: &Network) -> Result<Option<(LinkInfo, String)>, AgentError> {
        let id = &net.rec.sandbox_id;
        let Some(l) = self
            .nl
            .link_by_index(net.ifindex)
            .await
            .map_err(|e| failed("looking up the TAP by ifindex", &e))?
        else {
            return Ok(None);
        };
        let kind = if net.rec.attach.is_tap() {
            "TAP"
        } else {
            "veth"
        };
        let down = LinkChange {
            up: Some(false),
            ..Default::default()
        };
        let rename = LinkChange {
            name: Some(net.rec.tap_name.clone()),
            ..Default::default()
        };
        self.nl
            .set_link(l.index, down)
            .await
            .map_err(|e| failed("setting the renamed device down", &e))?;
        self.nl.set_link(l.index, rename).await.map_err(|e| {
            failed(
                &format!("renaming {} back to {}", l.name, net.rec.tap_name),
                &e,
            )
        })?;
        let why = format!(
            "{id}: {kind} {} had been renamed to {}, named back",
            net.rec.tap_name, l.name
        );
        Ok(Some((
            LinkInfo {
                name: net.rec.tap_name.clone(),
                up: false,
                ..l
            },
            why,
        )))
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
                // address stays reserved until ReleaseNetwork (CNI DEL/GC),
                // or until the agent finds the namespace gone (agent/cni.rs).
                net.ifindex = 0;
                out.gone = Some(format!(
                    "{id}: veth {} is gone (its container's network namespace was deleted?); \
                     CNI DEL or GC frees the network, or the agent once the namespace is gone",
                    net.rec.tap_name
                ));
            }
            None if net.rec.by_name() => {
                // Made again by name for its owner, with no fd: the VMM
                // that had it lost it with the device and may reopen it.
                let owner = net.rec.tap_owner.expect("by_name");
                match self
                    .by_name_tap(&net.rec.tap_name, net.rec.mtu, owner)
                    .await
                {
                    Ok(ifindex) => {
                        net.ifindex = ifindex;
                        out.repairs.push(format!(
                            "{id}: TAP {} was missing, recreated for {owner}",
                            net.rec.tap_name
                        ));
                    }
                    Err(e) => out.errors.push(format!("{id}: {e}")),
                }
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
