//! EnsureNetwork, ReleaseNetwork and OpenTap: each runs inside its
//! sandbox's slot (the per-sandbox critical section), changes the kernel,
//! the durable record, the read view and publishes its event there, and
//! undoes its own partial work when a step fails.

use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, info, warn};

use super::events::Change;
use super::pool::{self, PoolTap, create_tap};
use super::spec::{
    self, Attach, AttachRecord, Expect, NetnsFd, NetworkRecord, NetworkSpec, RECORD_VERSION,
    validate_sandbox_id,
};
use super::{
    Agent, AgentError, Allocs, Ensured, Network, Outcome, Wiring, failed, new_handle, now_unix,
};
use crate::alloc::mapping::{Resolved, resolve_ports};
use crate::netlink::LinkChange;
use crate::tap::Tap;
use crate::types::Bandwidth;

/// Which TAP a new network gets (see [`Agent::choose_tap`]).
pub(super) enum TapChoice {
    Warm(PoolTap),
    Cold(String),
}

impl TapChoice {
    fn name(&self) -> &str {
        match self {
            TapChoice::Warm(pt) => pt.tap.name(),
            TapChoice::Cold(name) => name,
        }
    }
}

impl Agent {
    /// EnsureNetwork: creates the network, or converges an existing one to
    /// `spec` without changing its address or TAP. The read view and the
    /// event are updated before the slot is let go, so no reader or edge
    /// can see this network's changes out of order.
    pub async fn ensure(&self, id: &str, spec: NetworkSpec) -> Result<Outcome, AgentError> {
        let started = Instant::now();
        validate_sandbox_id(id)?;
        let spec = self.normalise(spec.validated()?);
        spec.check_id(id)?;
        self.check_mtu(&spec)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            let done = match guard.as_mut() {
                Some(net) => match self.spec_for_clone(net, spec) {
                    Ok(spec) => self.converge(net, spec).await.map(|e| (net.view(), e)),
                    Err(e) => Err(e),
                },
                None => match self.create(id, spec).await {
                    Ok(net) => {
                        if net.rec.cloned_from.is_some() {
                            crate::metrics::NETWORKS_CLONED
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        let view = net.view();
                        *guard = Some(net);
                        Ok((view, Ensured::Created))
                    }
                    Err(e) => Err(e),
                },
            };
            done.map(|(view, change)| {
                let seq = if change == Ensured::Unchanged {
                    self.events.last()
                } else {
                    self.put_view(view.clone());
                    let seq = self.events.publish(Change::Ensured {
                        view: view.clone(),
                        created: change == Ensured::Created,
                    });
                    if change == Ensured::Created {
                        self.events.publish(Change::Node);
                    }
                    seq
                };
                Outcome { view, change, seq }
            })
        };
        if let Ok(Outcome { view, change, .. }) = &result {
            info!(
                sandbox_id = id,
                tap = view.record.tap_name,
                sandbox_ip = %view.record.sandbox_ip,
                outcome = ?change,
                elapsed_us = started.elapsed().as_micros() as u64,
                "network ensured"
            );
        }
        crate::metrics::ENSURE_LATENCY.observe(started.elapsed());
        self.forget_slot(id, slot);
        result
    }

    /// SetEgressRules: replaces an existing network's egress rules and
    /// nothing else (a CNI attachment's, whose conflist is no place for
    /// secrets; docs/egress.md "Egress rules"). As a converge: the datapath
    /// and the record first, then the view and the event, in the slot.
    pub async fn set_egress_rules(
        &self,
        id: &str,
        rules: Vec<crate::rules::EgressRule>,
    ) -> Result<Outcome, AgentError> {
        validate_sandbox_id(id)?;
        let rules = spec::validate_rules(rules)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            match guard.as_mut() {
                None => Err(AgentError::NotFound(id.to_owned())),
                Some(net) if net.rec.egress_rules == rules => Ok(Outcome {
                    view: net.view(),
                    change: Ensured::Unchanged,
                    seq: self.events.last(),
                }),
                Some(net) => {
                    let mut rec = (*net.rec).clone();
                    rec.egress_rules = rules;
                    let old = std::mem::replace(&mut net.rec, Arc::new(rec));
                    match self.apply_change(net, &old).await {
                        Err(e) => {
                            net.rec = old;
                            let _ = self.apply_change_kernel(net, None).await;
                            Err(e)
                        }
                        Ok(()) => {
                            let view = net.view();
                            self.put_view(view.clone());
                            let seq = self.events.publish(Change::Ensured {
                                view: view.clone(),
                                created: false,
                            });
                            Ok(Outcome {
                                view,
                                change: Ensured::Updated,
                                seq,
                            })
                        }
                    }
                }
            }
        };
        if let Ok(o) = &result {
            info!(
                sandbox_id = id,
                rules = o.view.record.egress_rules.len(),
                outcome = ?o.change,
                "egress rules set"
            );
        }
        self.forget_slot(id, slot);
        result
    }

    /// With `clone_of`, an existing network converges to its own spec
    /// (a retried clone changes nothing but metadata), if it is a clone
    /// of that source.
    fn spec_for_clone(&self, net: &Network, spec: NetworkSpec) -> Result<NetworkSpec, AgentError> {
        let Some(src) = &spec.clone_of else {
            return Ok(spec);
        };
        match &net.rec.cloned_from {
            Some(from) if from == src => Ok(NetworkSpec::of_record(&net.rec, &spec)),
            from => Err(AgentError::Conflict(format!(
                "clone_of: network '{}' exists and {}, not from '{src}'; release it first, or \
                 ensure it without clone_of",
                net.rec.sandbox_id,
                match from {
                    Some(f) => format!("was cloned from '{f}'"),
                    None => "was not made as a clone".to_owned(),
                }
            ))),
        }
    }

    /// The spec of a new clone: its source's (see [`NetworkSpec::clone_from`]).
    fn clone_spec(&self, id: &str, spec: NetworkSpec) -> Result<NetworkSpec, AgentError> {
        let Some(src) = &spec.clone_of else {
            return Ok(spec);
        };
        if src == id {
            return Err(AgentError::InvalidArgument(format!(
                "clone_of: '{id}' is the network being made; a clone needs another source"
            )));
        }
        let source = self
            .views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(src.as_str())
            .map(|v| v.record.clone())
            .ok_or_else(|| {
                AgentError::InvalidArgument(format!(
                    "clone_of: there is no network '{src}' to clone (it must exist while its \
                     clones are made)"
                ))
            })?;
        if !source.attach.is_tap() {
            return Err(AgentError::InvalidArgument(format!(
                "clone_of: '{src}' is a {} attachment (CNI); only TAP networks (VMs) are cloned",
                source.attach.name()
            )));
        }
        let from_source = |e: AgentError| match e {
            AgentError::InvalidArgument(m) => {
                AgentError::InvalidArgument(format!("clone_of: the spec of '{src}': {m}"))
            }
            other => other,
        };
        let mut cloned = NetworkSpec::clone_from(&source, &spec)
            .validated()
            .map_err(from_source)?;
        // A rate the source got from the node's defaults stays a default
        // (never refused, as for any network that asks for none).
        let d = &self.d.default_bandwidth;
        if d.egress_bps != 0 && cloned.bandwidth.egress_bps == d.egress_bps {
            cloned.bandwidth.egress_bps = 0;
        }
        if d.ingress_bps != 0 && cloned.bandwidth.ingress_bps == d.ingress_bps {
            cloned.bandwidth.ingress_bps = 0;
        }
        // The source's MTU was checked against the uplink when it was made;
        // the uplink may have changed since.
        self.check_mtu(&cloned).map_err(from_source)?;
        cloned.clone_of = spec.clone_of;
        Ok(self.normalise(cloned))
    }

    pub(super) async fn create(&self, id: &str, spec: NetworkSpec) -> Result<Network, AgentError> {
        let spec = self.clone_spec(id, spec)?;
        let claim = match &spec.attach {
            Attach::Veth { netns, .. } => {
                crate::netns::check_foreign_netns(std::os::fd::AsFd::as_fd(&*netns.fd))
                    .map_err(|why| AgentError::InvalidArgument(format!("netns_fd: {why}")))?;
                Some(self.claim_netns(id, netns.id).await?)
            }
            Attach::Tap => None,
        };
        let net = self.create_claimed(id, spec).await?;
        if let Some(claim) = claim {
            claim.keep();
        }
        Ok(net)
    }

    /// Takes network namespace `ns` for the CNI attachment `id`: one
    /// attachment per namespace, since each would put the same guest
    /// address and default route in it (the second took the first's
    /// route away). A namespace owned by a network whose veth is gone
    /// (the namespace died without a DEL, and the kernel reused its inode)
    /// is taken over. The claim is dropped unless kept.
    async fn claim_netns(&self, id: &str, ns: spec::NetnsId) -> Result<NetnsClaim<'_>, AgentError> {
        let owners = || self.netns_owners.lock().unwrap_or_else(|p| p.into_inner());
        let holder = {
            let mut o = owners();
            match o.get(&ns) {
                None => {
                    o.insert(ns, id.to_owned());
                    return Ok(NetnsClaim::new(self, ns, id));
                }
                Some(h) => h.clone(),
            }
        };
        // The holder's interface, if it has a view (none yet: it is being
        // created right now).
        let iface = self
            .views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&holder)
            .map(|v| (v.record.tap_name.clone(), v.tap_ifindex));
        let alive = match iface {
            None => true,
            Some((_, 0)) => false,
            Some((name, ifindex)) => self.still_named(&name, ifindex).await,
        };
        if !alive {
            let mut o = owners();
            if o.get(&ns) == Some(&holder) {
                o.insert(ns, id.to_owned());
                return Ok(NetnsClaim::new(self, ns, id));
            }
        }
        Err(AgentError::Conflict(format!(
            "netns_fd: network namespace {ns} already has an attachment ('{holder}'); one per \
             namespace: a second would put the same address ({}) and default route in it",
            self.d.guest_ip
        )))
    }

    async fn create_claimed(&self, id: &str, spec: NetworkSpec) -> Result<Network, AgentError> {
        self.check_limits(&spec.bandwidth, &Bandwidth::default())?;
        let tap_owner = spec.tap_owner();
        // A TAP handed over by name gets a name no TAP ever had here
        // (reserved first: a create that fails later wastes one).
        let by_name = match tap_owner {
            Some(_) => Some(self.fresh_by_name().await?),
            None => None,
        };
        let sockets = self
            .host_sockets(&spec, &[], self.reservations_of(id))
            .await?;
        let bandwidth = self.bandwidth_for(&spec.bandwidth);
        let requested = self.requested_address(&spec)?;
        let (ip, mappings) = {
            let mut a = self.allocs();
            let ip = match requested {
                Some(ip) => self.take_address(&mut a, ip).map(|()| ip)?,
                None => a.ips.allocate().ok_or_else(|| AgentError::NodeFull {
                    resource: "addresses",
                    detail: format!(
                        "no free sandbox address left in pool {} ({} in use)",
                        self.d.pool,
                        a.ips.capacity()
                    ),
                })?,
            };
            if let Err(e) = self.commit_bandwidth(&mut a, &Bandwidth::default(), &bandwidth) {
                a.ips.release(ip);
                return Err(e);
            }
            match resolve_ports(
                &mut a.ports,
                &spec.port_mappings,
                &[],
                &self.port_rules(&sockets),
            ) {
                Ok(r) => (ip, r.mappings),
                Err(e) => {
                    a.ips.release(ip);
                    a.bw.sub(&bandwidth);
                    return Err(e.into());
                }
            }
        };
        // A TAP keeps its pool name (the warm one taken now, or the name a
        // cold one will be created under); a veth's host end is created
        // under the sandbox's name.
        let tap = match spec.attach {
            Attach::Tap if by_name.is_none() => Some(self.choose_tap()),
            Attach::Tap | Attach::Veth { .. } => None,
        };
        let rec = NetworkRecord {
            version: RECORD_VERSION,
            sandbox_id: id.to_owned(),
            network_handle: new_handle(),
            sandbox_ip: IpAddr::V4(ip),
            tap_name: match (&tap, by_name) {
                (Some(choice), _) => choice.name().to_owned(),
                (None, Some(name)) => name,
                (None, None) => spec::tap_name_for(&self.cfg.tap_prefix, IpAddr::V4(ip)),
            },
            mtu: spec.mtu.unwrap_or(self.cfg.mtu),
            port_mappings: mappings,
            allow_internet_access: spec.allow_internet_access.unwrap_or(true),
            allow_out: spec.allow_out,
            deny_out: spec.deny_out,
            metadata: spec.metadata,
            idempotency_key: spec.idempotency_key,
            created_unix: now_unix(),
            attach: self.attach_record(&spec.attach).await,
            egress_mode: spec.egress_mode,
            bandwidth,
            cloned_from: spec.clone_of,
            paused: spec.paused,
            mapping_wins: spec.mapping_wins,
            tap_owner,
            egress_rules: spec.egress_rules,
        };
        let netns = match &spec.attach {
            Attach::Veth { netns, .. } => Some(netns),
            Attach::Tap => None,
        };
        // The record names everything the kernel work creates, so it is
        // written while that work runs: a crash in between leaves a record
        // whose TAP, neighbour or datapath entries are missing, which
        // recovery's repair ladder completes (the caller had no reply yet
        // and converges it again), or kernel state without a record, which
        // recovery retires (docs/design.md, "Order of operations").
        let bytes = rec.to_bytes();
        let (built, stored) =
            tokio::join!(self.bring_up(rec, netns, tap), self.store.put(id, bytes));
        match (built, stored) {
            (Ok(net), Ok(())) => Ok(net),
            (Ok(net), Err(e)) => {
                let err = failed("recording the network durably", &e);
                self.tear_down(net).await;
                Err(err)
            }
            (Err((rec, e)), stored) => {
                if stored.is_ok()
                    && let Err(de) = self.store.delete(id).await
                {
                    warn!(
                        sandbox_id = id,
                        error = crate::error_chain(&de),
                        "removing the record of a network that failed to come up; \
                         recovery will complete it at the next start"
                    );
                }
                self.release_allocs(&rec);
                Err(e)
            }
        }
    }

    /// The TAP a new network gets: a warm one from the pool, else the
    /// fresh pool name a cold one will be created under.
    fn choose_tap(&self) -> TapChoice {
        match self.pool.take() {
            Some(pt) => TapChoice::Warm(pt),
            None => TapChoice::Cold(self.pool.next_pool_name()),
        }
    }

    /// The limits a sandbox gets: the caller's, the node's default for a
    /// direction the caller left at 0.
    pub(super) fn bandwidth_for(&self, asked: &Bandwidth) -> Bandwidth {
        let d = &self.d.default_bandwidth;
        let mut b = *asked;
        if b.egress_bps == 0 {
            b.egress_bps = d.egress_bps;
        }
        if b.ingress_bps == 0 {
            b.ingress_bps = d.ingress_bps;
        }
        b
    }

    /// Refuses a limit the caller asks for (a new one: `have` is what the
    /// network has now) that the datapath cannot enforce: without an
    /// uplink or its shaper device for egress, without the eBPF datapath
    /// at all. The node's defaults are never refused (a node without an
    /// uplink sends nothing to the world anyway).
    fn check_limits(&self, asked: &Bandwidth, have: &Bandwidth) -> Result<(), AgentError> {
        let (egress, ingress) = self.datapath.shapes();
        if asked.egress_bps != 0 && asked.egress_bps != have.egress_bps && !egress {
            return Err(AgentError::InvalidArgument(
                "egress_bps: this node cannot enforce egress limits (no uplink, no eBPF \
                 datapath, or its shaper device could not be made: Health 'bandwidth')"
                    .into(),
            ));
        }
        if asked.ingress_bps != 0 && asked.ingress_bps != have.ingress_bps && !ingress {
            return Err(AgentError::InvalidArgument(
                "ingress_bps: this node cannot enforce limits (no eBPF datapath)".into(),
            ));
        }
        Ok(())
    }

    /// Moves a network's committed bandwidth from `old` to `new`, refused
    /// (NodeFull, nothing changed) if a direction that grows would commit
    /// more than the node's total (`node_egress_rate`/`node_ingress_rate`).
    pub(super) fn commit_bandwidth(
        &self,
        a: &mut Allocs,
        old: &Bandwidth,
        new: &Bandwidth,
    ) -> Result<(), AgentError> {
        let mut next = a.bw;
        next.sub(old);
        next.add(new);
        for (resource, key, total, was, is, asked) in [
            (
                "egress_bandwidth",
                "egress_bps",
                self.d.node_egress_bps,
                a.bw.egress_bps,
                next.egress_bps,
                new.egress_bps,
            ),
            (
                "ingress_bandwidth",
                "ingress_bps",
                self.d.node_ingress_bps,
                a.bw.ingress_bps,
                next.ingress_bps,
                new.ingress_bps,
            ),
        ] {
            if total != 0 && is > total && is > was {
                return Err(AgentError::NodeFull {
                    resource,
                    detail: format!(
                        "{key}: a limit of {asked} bits/s would commit {is} of the node's \
                         {total} ({was} committed)"
                    ),
                });
            }
        }
        a.bw = next;
        Ok(())
    }

    pub(super) fn release_allocs(&self, rec: &NetworkRecord) {
        let mut a = self.allocs();
        a.bw.sub(&rec.bandwidth);
        if let IpAddr::V4(ip) = rec.sandbox_ip {
            a.ips.release(ip);
        }
        for m in &rec.port_mappings {
            a.ports.release(m.protocol, m.host_port);
        }
    }

    /// TAP (warm or cold) or veth → name, MTU, up → neighbour → datapath.
    /// Undoes its own partial work on failure.
    pub(super) async fn bring_up(
        &self,
        rec: NetworkRecord,
        netns: Option<&NetnsFd>,
        tap: Option<TapChoice>,
    ) -> Result<Network, (NetworkRecord, AgentError)> {
        let net = match (&rec.attach, netns) {
            (AttachRecord::Veth { ifname, .. }, Some(netns)) => {
                let ifname = ifname.clone();
                match self.create_veth(&rec, &ifname, netns).await {
                    Ok(ifindex) => Network {
                        rec: Arc::new(rec),
                        ifindex,
                        tap: None,
                        handed_out: false,
                    },
                    Err(e) => return Err((rec, e)),
                }
            }
            (AttachRecord::Veth { .. }, None) => {
                return Err((
                    rec,
                    AgentError::InvalidArgument("attach 'veth' needs netns_fd".into()),
                ));
            }
            (AttachRecord::Tap, _) if rec.by_name() => {
                let owner = rec.tap_owner.expect("by_name");
                match self.by_name_tap(&rec.tap_name, rec.mtu, owner).await {
                    Ok(ifindex) => Network {
                        rec: Arc::new(rec),
                        ifindex,
                        tap: None,
                        // The owner may attach from the moment it exists.
                        handed_out: true,
                    },
                    Err(e) => return Err((rec, e)),
                }
            }
            (AttachRecord::Tap, _) => {
                // A warm TAP's MTU + up goes with the rest of the wiring.
                let (pt, change) = match tap.unwrap_or_else(|| self.choose_tap()) {
                    TapChoice::Warm(pt) => (pt, Some(in_use(rec.mtu))),
                    TapChoice::Cold(name) => match self.cold_tap(&name, rec.mtu).await {
                        Ok(pt) => (pt, None),
                        Err(e) => return Err((rec, e)),
                    },
                };
                debug_assert_eq!(rec.tap_name, pt.tap.name());
                let net = Network {
                    rec: Arc::new(rec),
                    ifindex: pt.ifindex,
                    tap: Some(pt.tap),
                    handed_out: false,
                };
                return self.wire_new(net, change).await;
            }
        };
        self.wire_new(net, None).await
    }

    /// [`Agent::wire`] for a network coming up; undoes on failure: a warm
    /// TAP whose `change` failed goes back to the pool, anything else is
    /// unwired and recycled.
    async fn wire_new(
        &self,
        mut net: Network,
        change: Option<LinkChange>,
    ) -> Result<Network, (NetworkRecord, AgentError)> {
        let warm = change.is_some();
        let how = super::Wire {
            link: change,
            neighbour: true,
        };
        let err = match self.wire(&net, how).await {
            Ok(()) => {
                if warm {
                    debug!(tap = net.rec.tap_name, "warm TAP taken from pool");
                }
                return Ok(net);
            }
            Err(Wiring::Link(e)) => {
                let err = failed(&format!("configuring pool TAP {}", net.rec.tap_name), &e);
                let rec = (*net.rec).clone();
                if let Some(tap) = net.tap.take() {
                    let pt = PoolTap {
                        tap,
                        ifindex: net.ifindex,
                    };
                    self.pool.give_back(pt).await;
                }
                return Err((rec, err));
            }
            Err(Wiring::Neighbour(e)) => failed("adding the neighbour entry", &e),
            Err(Wiring::Datapath(e)) => {
                let err = failed("programming the datapath", &e);
                self.unwire(&net).await;
                err
            }
        };
        let rec = (*net.rec).clone();
        self.recycle(&mut net).await;
        Err((rec, err))
    }

    /// The veth of a CNI attachment: host end named like a sandbox TAP,
    /// peer `ifname` (MAC = the guest MAC the datapath expects) created
    /// directly in the caller's namespace, host end up with IPv6 off.
    async fn create_veth(
        &self,
        rec: &NetworkRecord,
        ifname: &str,
        netns: &NetnsFd,
    ) -> Result<u32, AgentError> {
        use std::os::fd::AsFd;
        let host = rec.tap_name.as_str();
        let ifindex = match self
            .nl
            .create_veth(host, rec.mtu, ifname, self.d.guest_mac, netns.fd.as_fd())
            .await
        {
            Ok(i) => i,
            Err(e) if e.errno() == Some(libc::EEXIST) => {
                return Err(AgentError::InvalidArgument(format!(
                    "ifname: an interface named '{ifname}' already exists in the container's \
                     network namespace (or the host device {host} is left over; Reconcile \"\" \
                     removes it)"
                )));
            }
            Err(e) => return Err(failed(&format!("creating veth {host}"), &e)),
        };
        let name = host.to_owned();
        if let Err(error) = super::off_worker(move || crate::sysctl::disable_ipv6(&name)).await {
            debug!(veth = host, %error, "could not disable IPv6 on the veth");
        }
        let up = LinkChange {
            up: Some(true),
            ..Default::default()
        };
        if let Err(e) = self.nl.set_link(ifindex, up).await {
            let err = failed(&format!("setting veth {host} up"), &e);
            self.delete_veth(host, ifindex).await;
            return Err(err);
        }
        debug!(sandbox_id = rec.sandbox_id, veth = host, "veth created");
        Ok(ifindex)
    }

    /// Whether `ifindex` is still the link named `name` (the container's
    /// namespace may be gone already, and with it the pair).
    pub(super) async fn still_named(&self, name: &str, ifindex: u32) -> bool {
        match self.nl.link_by_index(ifindex).await {
            Ok(Some(l)) if l.name == name => true,
            Ok(_) => {
                debug!(veth = name, "veth already gone (its namespace was deleted)");
                false
            }
            Err(e) => {
                warn!(
                    veth = name,
                    error = crate::error_chain(&e),
                    "looking up the veth"
                );
                false
            }
        }
    }

    /// Deletes a veth host end (its peer goes with it) if it is still
    /// there. Best effort.
    pub(super) async fn delete_veth(&self, name: &str, ifindex: u32) {
        if self.still_named(name, ifindex).await
            && let Err(e) = self.nl.delete_link(ifindex).await
            && e.errno() != Some(libc::ENODEV)
        {
            warn!(
                veth = name,
                error = crate::error_chain(&e),
                "deleting the veth"
            );
        }
    }

    /// Takes a released veth off the reply path: one RTM_NEWLINK renames
    /// the host end out of the sandbox's name (the next network on this
    /// address needs it), sets it down (the peer loses its carrier) and
    /// moves it into the retire group, which the pool deletes in batches
    /// (a veth delete waits ~15 ms for RCU; batched, the wait is shared).
    /// Recovery deletes the retire group's leftovers after a crash. Falls
    /// back to deleting it at once.
    pub(super) async fn retire_veth(&self, name: &str, ifindex: u32) {
        if !self.still_named(name, ifindex).await {
            return;
        }
        let change = LinkChange {
            name: Some(spec::retired_veth_name(&self.cfg.tap_prefix, ifindex)),
            up: Some(false),
            group: Some(self.cfg.retire_group),
            ..Default::default()
        };
        match self.nl.set_link(ifindex, change).await {
            Ok(()) => self.pool.retire_link(ifindex),
            Err(e) => {
                debug!(
                    veth = name,
                    error = crate::error_chain(&e),
                    "retiring the veth"
                );
                self.delete_veth(name, ifindex).await;
            }
        }
    }

    /// Creates a TAP with its final name (pool empty, or recovery repair).
    pub(super) async fn cold_tap(&self, name: &str, mtu: u32) -> Result<PoolTap, AgentError> {
        let owned = name.to_owned();
        let pt = super::off_worker(move || create_tap(&owned))
            .await
            .map_err(|e| failed(&format!("creating TAP {name}"), &e))?;
        if let Err(e) = self.nl.set_link(pt.ifindex, in_use(mtu)).await {
            let err = failed(&format!("configuring TAP {name}"), &e);
            self.pool.retire(pt);
            return Err(err);
        }
        debug!(tap = name, "cold TAP created");
        Ok(pt)
    }

    /// A fresh name for a TAP handed over by name ([`pool::TapPool::fresh_by_name`]).
    async fn fresh_by_name(&self) -> Result<String, AgentError> {
        let (pool, dir) = (self.pool.clone(), self.store.dir().to_owned());
        super::off_worker(move || pool.fresh_by_name(&dir))
            .await
            .map_err(|e| failed("reserving a TAP name in the state directory", &e))
    }

    /// Creates a TAP handed over by name (recovery repair too): owned by
    /// `owner`, no fd kept, then MTU and up. Its ifindex.
    pub(super) async fn by_name_tap(
        &self,
        name: &str,
        mtu: u32,
        owner: spec::TapOwner,
    ) -> Result<u32, AgentError> {
        let owned = name.to_owned();
        let ifindex = super::off_worker(move || pool::create_by_name(&owned, owner))
            .await
            .map_err(|e| failed(&format!("creating TAP {name}"), &e))?;
        if let Err(e) = self.nl.set_link(ifindex, in_use(mtu)).await {
            let err = failed(&format!("configuring TAP {name}"), &e);
            self.pool.retire_link(ifindex);
            return Err(err);
        }
        debug!(tap = name, %owner, "TAP to be opened by name created");
        Ok(ifindex)
    }

    /// Removes the datapath state and the neighbour entry; best effort,
    /// errors are returned for the caller to report.
    pub(super) async fn unwire(&self, net: &Network) -> Vec<String> {
        self.unwire_counting(net, false).await.0
    }

    /// Returns the TAP to the pool if nobody but the agent ever held it;
    /// deletes it if it was handed out (OpenTap) or we hold no fd; retires
    /// a veth.
    pub(super) async fn recycle(&self, net: &mut Network) {
        if !net.rec.attach.is_tap() {
            if net.ifindex != 0 {
                self.retire_veth(&net.rec.tap_name, net.ifindex).await;
            }
            return;
        }
        // A TAP that carried a network never serves another: a VMM may
        // hold it (handed out), and even one nobody opened may hold frames
        // queued for this sandbox and has its counters (the next network's
        // traffic starts at zero on a new device).
        match net.tap.take() {
            Some(tap) => {
                let pt = PoolTap {
                    tap,
                    ifindex: net.ifindex,
                };
                self.pool.discard(pt).await
            }
            None if net.ifindex != 0 => self.pool.retire_link(net.ifindex),
            None => {}
        }
    }

    /// Puts back what [`Self::unwire`] removed.
    async fn rewire(&self, net: &Network) -> Result<(), AgentError> {
        let how = super::Wire {
            link: None,
            neighbour: true,
        };
        self.wire(net, how).await.map_err(|e| match e {
            Wiring::Neighbour(e) | Wiring::Link(e) => failed("adding the neighbour entry", &e),
            Wiring::Datapath(e) => failed("programming the datapath", &e),
        })
    }

    /// Undoes a whole network: datapath, neighbour, TAP, address, ports.
    pub(super) async fn tear_down(&self, net: Network) {
        let errors = self.unwire(&net).await;
        self.finish_tear_down(net, errors).await;
    }

    /// The rest of [`Self::tear_down`] once the network is unwired: TAP,
    /// address, ports; reports the unwiring's errors.
    async fn finish_tear_down(&self, mut net: Network, errors: Vec<String>) {
        self.recycle(&mut net).await;
        self.release_allocs(&net.rec);
        for error in errors {
            warn!(
                sandbox_id = net.rec.sandbox_id,
                tap = net.rec.tap_name,
                error,
                "teardown step failed"
            );
        }
    }

    pub(super) async fn converge(
        &self,
        net: &mut Network,
        spec: NetworkSpec,
    ) -> Result<Ensured, AgentError> {
        if !same_attachment(&net.rec.attach, &spec.attach.record()) {
            let (key, what, conflict) = match (&net.rec.attach, &spec.attach) {
                (AttachRecord::Veth { ifname, netns, .. }, Attach::Veth { ifname: want, .. })
                    if ifname == want =>
                {
                    (
                        "netns_fd",
                        format!(
                            "a veth in network namespace {}, not in the one passed",
                            netns.map_or("(unknown)".into(), |n| n.to_string())
                        ),
                        true,
                    )
                }
                (AttachRecord::Veth { ifname, .. }, _) => {
                    ("attach", format!("a veth (ifname '{ifname}')"), false)
                }
                (AttachRecord::Tap, _) => ("attach", "a tap".to_owned(), false),
            };
            let msg = format!(
                "{key}: sandbox '{}' is attached with {what}; the attachment cannot change \
                 (release the network first)",
                net.rec.sandbox_id,
            );
            return Err(if conflict {
                AgentError::Conflict(msg)
            } else {
                AgentError::InvalidArgument(msg)
            });
        }
        if spec.idempotency_key.is_some() && spec.idempotency_key == net.rec.idempotency_key {
            return Ok(Ensured::Unchanged);
        }
        let tap_owner = spec.tap_owner();
        if tap_owner.is_some() != net.rec.by_name() {
            let how = |o: Option<spec::TapOwner>| match o {
                Some(o) => format!("by name (tap_owner_uid: {o})"),
                None => "by fd (OpenTap)".to_owned(),
            };
            return Err(AgentError::InvalidArgument(format!(
                "tap_owner_uid: sandbox '{}' has its TAP handed over {}, not {}; how a TAP is \
                 handed over cannot change (release the network first)",
                net.rec.sandbox_id,
                how(net.rec.tap_owner),
                how(tap_owner),
            )));
        }
        self.check_same_address(&spec, &net.rec)?;
        if let (Some(have), Some(want)) = (net.rec.tap_owner, tap_owner)
            && have.gid.is_some()
            && want.gid.is_none()
        {
            return Err(AgentError::InvalidArgument(format!(
                "tap_owner_gid: sandbox '{}' has its TAP owned by {have}; the kernel cannot take \
                 a TAP's group away (give a group, or release the network first)",
                net.rec.sandbox_id
            )));
        }
        self.check_limits(&spec.bandwidth, &net.rec.bandwidth)?;
        let sockets = self
            .host_sockets(
                &spec,
                &net.rec.port_mappings,
                self.reservations_of(&net.rec.sandbox_id),
            )
            .await?;
        let (old_bw, new_bw) = (net.rec.bandwidth, self.bandwidth_for(&spec.bandwidth));
        let Resolved {
            mappings,
            claimed,
            stale,
        } = {
            let mut a = self.allocs();
            let r = resolve_ports(
                &mut a.ports,
                &spec.port_mappings,
                &net.rec.port_mappings,
                &self.port_rules(&sockets),
            )?;
            if let Err(e) = self.commit_bandwidth(&mut a, &old_bw, &new_bw) {
                for m in &r.claimed {
                    a.ports.release(m.protocol, m.host_port);
                }
                return Err(e);
            }
            r
        };
        let mut rec = (*net.rec).clone();
        rec.port_mappings = mappings;
        rec.allow_internet_access = spec.allow_internet_access.unwrap_or(true);
        rec.allow_out = spec.allow_out;
        rec.deny_out = spec.deny_out;
        rec.metadata = spec.metadata;
        rec.mtu = spec.mtu.unwrap_or(self.cfg.mtu);
        rec.idempotency_key = spec.idempotency_key;
        rec.egress_mode = spec.egress_mode;
        rec.bandwidth = new_bw;
        rec.paused = spec.paused;
        rec.mapping_wins = spec.mapping_wins;
        rec.tap_owner = tap_owner;
        rec.egress_rules = spec.egress_rules;
        let undo_claims = |this: &Self| {
            let mut a = this.allocs();
            for m in &claimed {
                a.ports.release(m.protocol, m.host_port);
            }
            a.bw.sub(&new_bw);
            a.bw.add(&old_bw);
        };
        if rec == *net.rec {
            undo_claims(self);
            return Ok(Ensured::Unchanged);
        }
        let old = std::mem::replace(&mut net.rec, Arc::new(rec));
        let result = self.apply_change(net, &old).await;
        if let Err(e) = result {
            net.rec = old;
            // Put the kernel side back the way it was (best effort).
            let _ = self.apply_change_kernel(net, None).await;
            undo_claims(self);
            return Err(e);
        }
        let mut a = self.allocs();
        for m in &stale {
            a.ports.release(m.protocol, m.host_port);
        }
        Ok(Ensured::Updated)
    }

    pub(super) async fn apply_change(
        &self,
        net: &Network,
        old: &NetworkRecord,
    ) -> Result<(), AgentError> {
        self.apply_change_kernel(net, Some(old)).await?;
        self.store
            .put(&net.rec.sandbox_id, net.rec.to_bytes())
            .await
            .map_err(|e| failed("recording the network durably", &e))
    }

    pub(super) async fn apply_change_kernel(
        &self,
        net: &Network,
        old: Option<&NetworkRecord>,
    ) -> Result<(), AgentError> {
        if old.is_none_or(|o| o.mtu != net.rec.mtu) {
            let change = LinkChange {
                mtu: Some(net.rec.mtu),
                ..Default::default()
            };
            self.nl
                .set_link(net.ifindex, change)
                .await
                .map_err(|e| failed(&format!("setting the MTU of {}", net.rec.tap_name), &e))?;
        }
        if let Some(owner) = net.rec.tap_owner
            && old.is_none_or(|o| o.tap_owner != net.rec.tap_owner)
        {
            // The kernel's owner check runs when a process attaches: a new
            // owner for a TAP a VMM holds would not stop that VMM, so it is
            // refused until the VMM lets go (TUNSETIFF answers EBUSY).
            let name = net.rec.tap_name.clone();
            super::off_worker(move || pool::set_by_name_owner(&name, owner))
                .await
                .map_err(|e| match e.errno() {
                    Some(libc::EBUSY) => AgentError::TapBusy {
                        tap: net.rec.tap_name.clone(),
                        why: "a new tap_owner_uid/tap_owner_gid applies once the VMM that has \
                              it open closes it",
                    },
                    _ => failed(
                        &format!("changing the owner of TAP {}", net.rec.tap_name),
                        &e,
                    ),
                })?;
        }
        self.dp_attach(net)
            .await
            .map_err(|e| failed("programming the datapath", &e))
    }

    /// ReleaseNetwork: the `Released` event's sequence number, `None` if
    /// there was no such network.
    pub async fn release(&self, id: &str) -> Result<Option<u64>, AgentError> {
        self.release_if(id, &Expect::default()).await
    }

    /// ReleaseNetworkIf: releases the network only if it is what the
    /// caller expects (its handle, attachment, interface, namespace,
    /// metadata): checked and released in the network's slot, so nothing
    /// can change the network between the check and the release.
    pub async fn release_if(&self, id: &str, expect: &Expect) -> Result<Option<u64>, AgentError> {
        let started = Instant::now();
        validate_sandbox_id(id)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            if let Some(net) = guard.as_ref()
                && let Err(e) = expect.check(&net.rec)
            {
                drop(guard);
                self.forget_slot(id, slot);
                return Err(e);
            }
            match guard.take() {
                None => Ok(None),
                // The sandbox is cut off (datapath, neighbour) while its
                // record's removal is made durable. A crash in between
                // leaves the record, and recovery wires the network again
                // (the caller had no reply); if the removal fails, the
                // wiring is put back here and the network stays.
                Some(net) => {
                    match tokio::join!(self.store.delete(id), self.unwire_counting(&net, true)) {
                        (Err(e), _) => {
                            let err = failed("removing the record", &e);
                            if let Err(e) = self.rewire(&net).await {
                                warn!(
                                    sandbox_id = id,
                                    error = %e,
                                    "re-wiring a network whose release failed; Reconcile repairs it"
                                );
                            }
                            *guard = Some(net);
                            Err(err)
                        }
                        (Ok(()), (errors, traffic)) => {
                            self.remove_view(id);
                            let seq = self.events.publish(Change::Released {
                                sandbox_id: id.to_owned(),
                            });
                            let (tap, ip) = (net.rec.tap_name.clone(), net.rec.sandbox_ip);
                            // The totals, for billing after the network is gone:
                            // the datapath no longer forwards for it.
                            let t = match traffic.expect("counted") {
                                Ok(t) => t,
                                Err(e) => {
                                    warn!(sandbox_id = id, error = %e, "reading the released network's counters failed");
                                    Default::default()
                                }
                            };
                            if let AttachRecord::Veth {
                                netns: Some(ns), ..
                            } = &net.rec.attach
                            {
                                self.let_go_netns(*ns, id);
                            }
                            self.note_reservations(&net.rec).await;
                            self.finish_tear_down(net, errors).await;
                            self.events.publish(Change::Node);
                            info!(
                                sandbox_id = id,
                                tap,
                                sandbox_ip = %ip,
                                tx_bytes = t.tx_bytes,
                                tx_packets = t.tx_packets,
                                tx_dropped = t.tx_dropped,
                                rx_bytes = t.rx_bytes,
                                rx_packets = t.rx_packets,
                                rx_dropped = t.rx_dropped,
                                datapath_drops = t
                                    .drops()
                                    .map(|(r, n)| format!("{r}={n}"))
                                    .collect::<Vec<_>>()
                                    .join(" "),
                                new_flows = t
                                    .new_flows()
                                    .map(|(k, n)| format!("{k}={n}"))
                                    .collect::<Vec<_>>()
                                    .join(" "),
                                elapsed_us = started.elapsed().as_micros() as u64,
                                "network released"
                            );
                            Ok(Some(seq))
                        }
                    }
                }
            }
        };
        crate::metrics::RELEASE_LATENCY.observe(started.elapsed());
        self.forget_slot(id, slot);
        result
    }

    /// OpenTap: a fresh duplicate of the agent's TAP fd. A network adopted
    /// without an fd (the agent restarted without its fd store while a VMM
    /// held the TAP) gets its TAP re-attached here once the holder let go.
    /// From the first duplicate on, the TAP counts as handed out: another
    /// process may hold it until it exits, so release deletes it instead
    /// of pooling it (docs/security.md).
    pub async fn open_tap(&self, id: &str) -> Result<OwnedFd, AgentError> {
        validate_sandbox_id(id)?;
        let slot = self.slot(id);
        let result = {
            let mut guard = slot.lock().await;
            match guard.as_mut() {
                None => Err(AgentError::NotFound(id.to_owned())),
                Some(net) if !net.rec.attach.is_tap() => Err(AgentError::InvalidArgument(format!(
                    "sandbox '{id}' is attached with a veth (CNI); it has no TAP to open"
                ))),
                // An fd of the agent's would take the TAP's only queue: the
                // VMM could not attach by name, or holds it already.
                Some(net) if net.rec.by_name() => Err(AgentError::InvalidArgument(format!(
                    "sandbox '{id}' has its TAP handed over by name (tap_owner_uid: {}): the \
                     VMM opens TAP {} itself, and the agent holds no fd of it to hand out",
                    net.rec.tap_owner.expect("by_name"),
                    net.rec.tap_name
                ))),
                Some(net) => self.hand_out(net).await,
            }
        };
        self.forget_slot(id, slot);
        result
    }

    /// A duplicate of the network's TAP fd (re-attaching the TAP first if
    /// the network was adopted without one); marks the TAP handed out.
    /// Called with the network's slot held.
    async fn hand_out(&self, net: &mut Network) -> Result<OwnedFd, AgentError> {
        let reattached = self.reattach_fd(net).await?;
        let tap = net.tap.as_ref().expect("reattach_fd leaves an fd or fails");
        if reattached {
            self.events.publish(Change::Repaired {
                view: net.view(),
                repairs: vec![format!(
                    "{}: TAP {} re-attached (adopted without an fd, its holder let go)",
                    net.rec.sandbox_id, net.rec.tap_name
                )],
            });
        }
        let fd = tap
            .dup()
            .map_err(|e| failed("duplicating the TAP fd", &e))?;
        if !net.handed_out && net.rec.cloned_from.is_some() {
            // A clone's first VMM: a snapshot restored onto it.
            crate::metrics::CLONES_RESTORED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        net.handed_out = true;
        Ok(fd)
    }

    /// Gives a network adopted without an fd its TAP back: TUNSETIFF on the
    /// device succeeds once no other process holds its (single) queue.
    /// `Ok(true)` if it re-attached now, `Ok(false)` if the fd was there.
    /// Called with the network's slot held.
    pub(super) async fn reattach_fd(&self, net: &mut Network) -> Result<bool, AgentError> {
        // A TAP handed over by name is never opened by the agent: its VMM
        // may attach to it at any time.
        if net.tap.is_some() || !net.rec.attach.is_tap() || net.rec.by_name() {
            return Ok(false);
        }
        // TUNSETIFF takes RTNL: off the async workers.
        let (name, ifindex) = (net.rec.tap_name.clone(), net.ifindex);
        let opened = super::off_worker(move || {
            Tap::open_existing(&name).inspect(|tap| pool::store_fd(ifindex, tap))
        })
        .await;
        match opened {
            Ok(tap) => {
                net.tap = Some(tap);
                self.set_view(net);
                info!(
                    sandbox_id = net.rec.sandbox_id.as_str(),
                    tap = net.rec.tap_name.as_str(),
                    "TAP re-attached: the process that held it let go"
                );
                Ok(true)
            }
            Err(e) if e.errno() == Some(libc::EBUSY) => Err(AgentError::TapBusy {
                tap: net.rec.tap_name.clone(),
                why: "the agent has no fd of its own since it restarted without its fd store; \
                      OpenTap re-attaches it once that process closes it",
            }),
            Err(e) => Err(failed(&format!("re-opening TAP {}", net.rec.tap_name), &e)),
        }
    }
}

/// Whether a converge asks for the attachment the network has. A record
/// from before namespaces were kept matches any namespace.
fn same_attachment(have: &AttachRecord, want: &AttachRecord) -> bool {
    match (have, want) {
        (
            AttachRecord::Veth { ifname, netns, .. },
            AttachRecord::Veth {
                ifname: want_ifname,
                netns: want_netns,
                ..
            },
        ) => ifname == want_ifname && (netns.is_none() || netns == want_netns),
        _ => have == want,
    }
}

/// A network namespace taken for a CNI attachment being created; given
/// back on drop unless [`NetnsClaim::keep`] was called.
struct NetnsClaim<'a> {
    agent: &'a Agent,
    ns: spec::NetnsId,
    id: String,
    kept: bool,
}

impl<'a> NetnsClaim<'a> {
    fn new(agent: &'a Agent, ns: spec::NetnsId, id: &str) -> Self {
        NetnsClaim {
            agent,
            ns,
            id: id.to_owned(),
            kept: false,
        }
    }

    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for NetnsClaim<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.agent.let_go_netns(self.ns, &self.id);
        }
    }
}

impl Agent {
    /// Gives namespace `ns` up if `id` still owns it.
    fn let_go_netns(&self, ns: spec::NetnsId, id: &str) {
        let mut o = self.netns_owners.lock().unwrap_or_else(|p| p.into_inner());
        if o.get(&ns).is_some_and(|h| h == id) {
            o.remove(&ns);
        }
    }
}

/// The change that puts a TAP in service: MTU, up, the in-use alias. One
/// RTM_NEWLINK, no rename (a rename re-registers the device's sysctls and
/// waits for RCU under RTNL, ~250 µs measured, twice per ensure+release
/// pair): a TAP keeps its pool name for life, the record says whose it is.
fn in_use(mtu: u32) -> LinkChange {
    LinkChange {
        mtu: Some(mtu),
        up: Some(true),
        alias: Some(pool::IN_USE_ALIAS),
        ..Default::default()
    }
}
