//! The reaper: every 2 s a pass over the flow tables (batched dumps)
//! removes expired flows and those of released sandboxes, recounts each
//! sandbox's host-flow share, and forgets attachments and counters of
//! devices that are gone.

use super::*;

/// How long a guest's DNS exchange over UDP keeps its host-flow entry
/// when idle (the resolver answers within 3 s or not at all).
const DNS_UDP_IDLE: Duration = Duration::from_secs(10);

/// The reaper looks for attachments of devices that no longer exist on
/// every this many passes (the first included): one lookup per TAP.
const GONE_CHECK_EVERY: u64 = 15;

impl EbpfDatapath {
    pub(super) fn reap(&self) {
        let now = monotonic_ns();
        let t = self.node.timeouts;
        let mut guard = self.reaper.lock().unwrap_or_else(|p| p.into_inner());
        let r = &mut *guard;
        // Which generation owns each address now: a flow of another one
        // belongs to a released sandbox (or an earlier owner).
        let taps: StdHashMap<u32, DpTap> = dump_flows::<u32, DpTap>(&r.by_ip_dump)
            .unwrap_or_else(|| r.by_ip.iter().flatten().collect())
            .into_iter()
            .collect();
        let owners: StdHashMap<u32, u64> = taps.iter().map(|(ip, t)| (*ip, t.generation)).collect();
        let mut pass = FlowPass {
            owners: &owners,
            now,
            timeouts: t,
            by_sandbox: StdHashMap::new(),
            seen: 0,
            snat: 0,
            removed: 0,
            stale: 0,
        };
        let all = dump_flows(&r.ct_dump).unwrap_or_else(|| r.ct.iter().flatten().collect());
        let mut ends = Ends {
            ended: &mut r.ended,
            pass: r.passes,
            out: vec![],
        };
        ends.closed(&all, flow_id4);
        for (k, v) in pass.doomed(all, |k: &DpCtKey| (k.sandbox_ip, k.proto)) {
            // Re-read right before deleting: a flow touched or replaced since
            // the dump (still live, or the new owner's) waits for the next
            // pass, whichever way it was doomed.
            if r.ct.get(&k, 0).ok().as_ref() == Some(&v) && pass.confirm(&r.by_ip, k.sandbox_ip, &v)
            {
                Self::remove_flow(&mut r.ct, &mut r.ct_rev, &k, &v);
                ends.removed(flow_id4(&k), &v);
            }
        }
        let ipv4_live = pass.seen - pass.removed;
        let all = dump_flows(&r.ct6_dump).unwrap_or_else(|| r.ct6.iter().flatten().collect());
        ends.closed6(&all);
        for (k, v) in pass.doomed(all, |k: &DpCt6Key| (k.sandbox_ip, k.proto)) {
            if r.ct6.get(&k, 0).ok().as_ref() == Some(&v)
                && pass.confirm(&r.by_ip, k.sandbox_ip, &v)
            {
                Self::remove_flow6(&mut r.ct6, &mut r.ct_rev6, &k, &v);
                ends.removed6(&k, &v);
            }
        }
        let Ends {
            out,
            pass: now_pass,
            ended,
        } = ends;
        // Ends reported of flows no longer in the tables (removed, or
        // evicted) are forgotten.
        ended.retain(|_, seen| *seen == now_pass);
        if !out.is_empty() {
            let mut q = self.flow_ends.lock().unwrap_or_else(|p| p.into_inner());
            q.extend(out);
            let over = q.len().saturating_sub(crate::datapath::FLOW_ENDS_MAX);
            q.drain(..over);
        }
        let FlowPass {
            by_sandbox,
            seen: flows,
            snat,
            removed,
            stale: stale_n,
            ..
        } = pass;
        *self
            .stats
            .by_sandbox
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = by_sandbox;
        let (host_flows, host_removed, hf) = Self::reap_host_flows(r, &taps, now, t);
        if !hf.is_empty() {
            let mut q = self.host_flows.lock().unwrap_or_else(|p| p.into_inner());
            q.extend(hf);
            let over = q.len().saturating_sub(crate::datapath::FLOW_ENDS_MAX);
            q.drain(..over);
        }
        // Attachment records of TAPs that no longer exist.
        let (mut taps, mut own) = (0usize, 0usize);
        r.passes += 1;
        let look = r.passes % GONE_CHECK_EVERY == 1;
        // One lookup per device, however many maps hold it.
        let mut exists = Exists::default();
        let gone: Vec<u32> = dump_flows::<u32, u32>(&r.attached_dump)
            .unwrap_or_else(|| r.attached.iter().flatten().collect())
            .into_iter()
            .inspect(|(_, how)| {
                taps += 1;
                own += usize::from(*how == OWN_FILTER);
            })
            .map(|(i, _)| i)
            .filter(|i| look && !exists.check(*i))
            .collect();
        for i in &gone {
            let _ = r.attached.remove(i);
        }
        // Counters of devices that are gone (released networks' TAPs and
        // veths are deleted off the release path).
        if look {
            let keys: Vec<u32> = dump_flows::<u32, DpSbStats>(&r.sb_dump)
                .unwrap_or_else(|| r.sb_stats.iter().flatten().collect())
                .into_iter()
                .map(|(i, _)| i)
                .collect();
            for i in keys.into_iter().filter(|i| !exists.check(*i)) {
                let _ = r.sb_stats.remove(&i);
            }
            let keys: Vec<u32> = dump_per_cpu(&r.traffic6_dump, |_: &[DpTraffic6]| ())
                .map(|all| all.into_iter().map(|(i, ())| i).collect())
                .unwrap_or_else(|| r.sb_traffic6.keys().flatten().collect());
            for i in keys.into_iter().filter(|i| !exists.check(*i)) {
                let _ = r.sb_traffic6.remove(&i);
            }
            let rates: Vec<u32> = dump_flows::<u32, DpRate>(&r.rate_dump)
                .unwrap_or_else(|| r.sb_rate.iter().flatten().collect())
                .into_iter()
                .map(|(i, _)| i)
                .collect();
            for i in rates.into_iter().filter(|i| !exists.check(*i)) {
                let _ = r.sb_rate.remove(&i);
            }
            let shares: Vec<u32> = Self::shares(r).into_keys().collect();
            for i in shares.into_iter().filter(|i| !exists.check(*i)) {
                let _ = r.sb_share.remove(&i);
            }
            let woken: Vec<u32> = r.wake_sent.keys().flatten().collect();
            for i in woken.into_iter().filter(|i| !exists.check(*i)) {
                let _ = r.wake_sent.remove(&i);
            }
            let orphans = Self::reap_orphan_hrev(r);
            if orphans > 0 {
                debug!(
                    entries = orphans,
                    "hrev entries without a host flow removed"
                );
            }
        }
        {
            let mut o = self.own_filter.lock().unwrap_or_else(|p| p.into_inner());
            o.retain(|i| !gone.contains(i));
            own = own.min(o.len());
        }
        self.stats.own.store(own, Ordering::Relaxed);
        self.stats.flows.store(flows - removed, Ordering::Relaxed);
        self.stats
            .flows6
            .store(flows - removed - ipv4_live, Ordering::Relaxed);
        self.stats.snat_flows.store(snat, Ordering::Relaxed);
        self.stats
            .host_flows
            .store(host_flows - host_removed, Ordering::Relaxed);
        self.stats.taps.store(taps - gone.len(), Ordering::Relaxed);
        self.stats
            .reaped
            .fetch_add((removed + host_removed) as u64, Ordering::Relaxed);
        if removed + host_removed > 0 {
            debug!(
                flows = removed,
                of_released_sandboxes = stale_n,
                host_flows = host_removed,
                "expired flows and flows of released sandboxes reaped"
            );
        }
    }

    /// Removes a flow, and its SNAT reverse entry if that still points at
    /// it (a port may have gone to another flow since).
    fn remove_flow(
        ct: &mut HashMap<MapData, DpCtKey, DpCtVal>,
        ct_rev: &mut HashMap<MapData, DpRevKey, DpRevVal>,
        k: &DpCtKey,
        v: &DpCtVal,
    ) {
        let _ = ct.remove(k);
        if v.kind == DP_CT_SNAT {
            let rk = DpRevKey {
                remote_ip: k.remote_ip,
                remote_port: k.remote_port,
                nat_port: v.nat_port,
                proto: k.proto,
                pad: [0; 3],
            };
            if ct_rev.get(&rk, 0).is_ok_and(|r| {
                r.sandbox_ip == k.sandbox_ip
                    && r.guest_port == k.guest_port
                    && r.generation == v.generation
            }) {
                let _ = ct_rev.remove(&rk);
            }
        }
    }

    /// Removes a NAT66 flow, and its reverse entry if that still points at
    /// it.
    fn remove_flow6(
        ct6: &mut HashMap<MapData, DpCt6Key, DpCtVal>,
        ct_rev6: &mut HashMap<MapData, DpRev6Key, DpRevVal>,
        k: &DpCt6Key,
        v: &DpCtVal,
    ) {
        let _ = ct6.remove(k);
        if v.kind != DP_CT_SNAT {
            // A flow the world opened to a port mapping has no reverse entry.
            return;
        }
        let rk = DpRev6Key {
            remote_ip: k.remote_ip,
            remote_port: k.remote_port,
            nat_port: v.nat_port,
            proto: k.proto,
            pad: [0; 3],
        };
        if ct_rev6.get(&rk, 0).is_ok_and(|r| {
            r.sandbox_ip == k.sandbox_ip
                && r.guest_port == k.guest_port
                && r.pad == u16::from(k.gaddr)
                && r.generation == v.generation
        }) {
            let _ = ct_rev6.remove(&rk);
        }
    }

    /// The reaper's pass over host flows: host connections in the SNAT
    /// range (`host_nat`) and host <-> sandbox flows (`hflow`), expired by
    /// the same timeouts, host <-> sandbox flows also when their sandbox
    /// was released (generation). Each is re-read right before it is
    /// deleted (a flow touched since the dump waits for the next pass), and
    /// its reverse entry goes with it only if that still points at it.
    /// Returns (flows seen, flows removed).
    fn reap_host_flows(
        r: &mut Reaper,
        taps: &StdHashMap<u32, DpTap>,
        now: u64,
        t: FlowTimeouts,
    ) -> (usize, usize, Vec<crate::datapath::HostFlow>) {
        let expired = |proto: u8, state: u8, last: u64| {
            now.saturating_sub(last) > t.limit(proto, state).as_nanos() as u64
        };
        // A guest's DNS over UDP (to its gateway, or redirected to the
        // resolver) is done within the resolver's upstream timeout: its
        // entries go after DNS_UDP_IDLE, not the UDP timeout, so a guest
        // that resolves a lot holds few of its share.
        let dns_udp = |k: &DpHflowKey, v: &DpHflowVal| {
            k.proto == libc::IPPROTO_UDP as u8
                && v.gw_port == 53u16.to_be()
                && now.saturating_sub(v.last_seen_ns) > DNS_UDP_IDLE.as_nanos() as u64
        };
        let (mut seen, mut removed) = (0, 0);
        let nat: Vec<(DpRevKey, DpCtVal)> =
            dump_flows(&r.host_nat_dump).unwrap_or_else(|| r.host_nat.iter().flatten().collect());
        seen += nat.len();
        for (k, v) in nat {
            if !expired(k.proto, v.state, v.last_seen_ns)
                || r.host_nat.get(&k, 0).ok().as_ref() != Some(&v)
            {
                continue;
            }
            let _ = r.host_nat.remove(&k);
            let rk = DpRevKey {
                nat_port: v.nat_port,
                ..k
            };
            if r.ct_rev
                .get(&rk, 0)
                .is_ok_and(|rv| rv.sandbox_ip == 0 && rv.guest_port == k.nat_port)
            {
                let _ = r.ct_rev.remove(&rk);
            }
            removed += 1;
        }
        let hflows: Vec<(DpHflowKey, DpHflowVal)> =
            dump_flows(&r.hflow_dump).unwrap_or_else(|| r.hflow.iter().flatten().collect());
        // Every sandbox's share, right after the dump: what the datapath
        // adds and gives back from here on is carried over (see below).
        let before = Self::shares(r);
        seen += hflows.len();
        let mut held: StdHashMap<u32, [i64; 2]> = StdHashMap::new();
        // The flow log: starts (not in the last pass) and ends (in the
        // last pass, not in this one, or removed now).
        let mut log = vec![];
        let host_flow = |start: bool, k: &DpHflowKey, v: &DpHflowVal| crate::datapath::HostFlow {
            start,
            sandbox_ip: Ipv4Addr::from(v.sandbox_ip.to_ne_bytes()),
            ipv6: k.family == DP_HFAM_IPV6,
            proto: k.proto,
            node_opened: v.flags & DP_HFF_HOST_OPENED != 0 || v.kind == DP_HF_LO,
            node: Ipv4Addr::from(k.saddr.to_ne_bytes()),
            node_port: u16::from_be(k.sport),
            guest_port: u16::from_be(v.guest_port),
            gw_port: u16::from_be(v.gw_port),
            seen_ns: now,
        };
        let mut last = std::mem::take(&mut r.hseen);
        let closed = |s: u8| {
            s & DP_TCP_RST != 0
                || s & (DP_TCP_FIN_OUT | DP_TCP_FIN_IN) == DP_TCP_FIN_OUT | DP_TCP_FIN_IN
        };
        let end_of = |f: crate::datapath::HostFlow| crate::datapath::HostFlow {
            start: false,
            seen_ns: now,
            ..f
        };
        for (k, v) in &hflows {
            let f = host_flow(true, k, v);
            let mut ended = match last.remove(k) {
                Some((g, _, ended)) if g == v.generation => ended,
                Some((_, old, ended)) => {
                    // Another owner's flow on the key: the old one ended.
                    if !ended {
                        log.push(end_of(old));
                    }
                    log.push(f);
                    false
                }
                None => {
                    log.push(f);
                    false
                }
            };
            // A closed TCP flow ends now (its entry lives on a while).
            if !ended && k.proto == libc::IPPROTO_TCP as u8 && closed(v.state) {
                log.push(end_of(f));
                ended = true;
            }
            r.hseen.insert(*k, (v.generation, f, ended));
        }
        // In the last pass, not in this one: ended between the two (the
        // datapath replaced or removed it).
        for (_, (_, old, ended)) in last {
            if !ended {
                log.push(end_of(old));
            }
        }
        for (k, v) in hflows {
            let owner = taps
                .get(&v.sandbox_ip)
                .filter(|o| o.generation == v.generation);
            let stale = owner.is_none();
            if !(stale || expired(k.proto, v.state, v.last_seen_ns) || dns_udp(&k, &v))
                || r.hflow.get(&k, 0).ok().as_ref() != Some(&v)
                || (stale
                    && r.by_ip
                        .get(&v.sandbox_ip, 0)
                        .is_ok_and(|o| o.generation == v.generation))
            {
                if let Some(o) = owner {
                    held.entry(o.ifindex).or_default()[usize::from(hflow_budget(&v))] += 1;
                }
                continue;
            }
            let _ = r.hflow.remove(&k);
            if let Some((_, _, false)) = r.hseen.remove(&k) {
                log.push(host_flow(false, &k, &v));
            }
            let rk = DpHrevKey {
                sandbox_ip: v.sandbox_ip,
                guest_port: v.guest_port,
                gw_port: v.gw_port,
                proto: k.proto,
                family: k.family,
                pad: [0; 2],
            };
            if r.hrev.get(&rk, 0).is_ok_and(|rv| rv.host == k) {
                let _ = r.hrev.remove(&rk);
            }
            removed += 1;
        }
        Self::recount_shares(r, &before, &held);
        // The first pass of a start only learns what is there: the
        // previous run recorded those flows' starts.
        if r.passes == 0 {
            log.retain(|f| !f.start);
        }
        (seen, removed, log)
    }

    /// Every sandbox's `sb_share` entry (ifindex -> its host flows of each
    /// budget, the guest's own and others', and the rest of the entry,
    /// which the datapath owns).
    fn shares(r: &Reaper) -> StdHashMap<u32, ([i64; 2], DpShare)> {
        dump_flows::<u32, DpShare>(&r.sb_share_dump)
            .unwrap_or_else(|| r.sb_share.iter().flatten().collect())
            .into_iter()
            .map(|(i, s)| (i, (DpShare::budgets(s.hflow), s)))
            .collect()
    }

    /// Sets each sandbox's share to the host flows it holds: `held` (the
    /// entries this pass saw and kept) plus what the datapath changed since
    /// `before` was read (flows opened and closed meanwhile). The
    /// datapath's own counting is exact for what it adds and removes; this
    /// corrects what it cannot see (entries the reaper removed, an earlier
    /// owner's). The shared pool follows from the counts.
    fn recount_shares(
        r: &mut Reaper,
        before: &StdHashMap<u32, ([i64; 2], DpShare)>,
        held: &StdHashMap<u32, [i64; 2]>,
    ) {
        const BPF_EXIST: u64 = 2;
        let g = r.hflow_shares.budgets_guaranteed().map(i64::from);
        let now = Self::shares(r);
        let mut borrowed = [0i64; 2];
        for (ifindex, (current, entry)) in &now {
            let mut n = [0i64; 2];
            for b in 0..2 {
                let meanwhile = current[b] - before.get(ifindex).map_or(current[b], |x| x.0[b]);
                n[b] = (held.get(ifindex).map_or(0, |h| h[b]) + meanwhile).clamp(0, 0xffff);
                borrowed[b] += (n[b] - g[b]).max(0);
            }
            if n != *current {
                // The guest's address as read: should the guest change it
                // between the read and this write, its next packet from
                // the new one writes it again.
                let _ = r.sb_share.insert(
                    ifindex,
                    DpShare {
                        hflow: DpShare::packed(n),
                        ..*entry
                    },
                    BPF_EXIST,
                );
            }
        }
        let _ = r.share_pool.set(
            0,
            DpSharePool {
                hflow_borrowed: (borrowed[0] + borrowed[1]).min(i64::from(u32::MAX)) as u32,
                hflow_borrowed_in: borrowed[1].min(i64::from(u32::MAX)) as u32,
            },
            0,
        );
    }

    /// `hrev` entries whose host flow is gone (its removal raced with a
    /// takeover): removed so the map holds no more than `hflow`.
    fn reap_orphan_hrev(r: &mut Reaper) -> usize {
        let all: Vec<(DpHrevKey, DpHrevVal)> =
            dump_flows(&r.hrev_dump).unwrap_or_else(|| r.hrev.iter().flatten().collect());
        let mut n = 0;
        for (k, v) in all {
            let live = r.hflow.get(&v.host, 0).is_ok_and(|f| {
                f.sandbox_ip == k.sandbox_ip
                    && f.guest_port == k.guest_port
                    && f.gw_port == k.gw_port
            });
            if !live && r.hrev.get(&k, 0).ok().as_ref() == Some(&v) {
                let _ = r.hrev.remove(&k);
                n += 1;
            }
        }
        n
    }
}

/// Whether devices exist, each looked up once per pass (a look pass
/// checks the same 10,000 ifindexes in five maps), on one socket
/// (`if_indextoname` opens and closes one per lookup).
#[derive(Default)]
struct Exists {
    seen: StdHashMap<u32, bool>,
    sock: Option<Option<std::os::fd::OwnedFd>>,
}

impl Exists {
    fn check(&mut self, ifindex: u32) -> bool {
        if let Some(e) = self.seen.get(&ifindex) {
            return *e;
        }
        let sock = self.sock.get_or_insert_with(|| {
            nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Unix,
                nix::sys::socket::SockType::Datagram,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                None,
            )
            .ok()
        });
        let e = match sock {
            Some(fd) => {
                ifindex_exists(fd.as_fd(), ifindex).unwrap_or_else(|_| link_exists(ifindex))
            }
            None => link_exists(ifindex),
        };
        self.seen.insert(ifindex, e);
        e
    }
}

/// SIOCGIFNAME on `sock`: whether a device has `ifindex` (ENODEV: none).
fn ifindex_exists(sock: BorrowedFd<'_>, ifindex: u32) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero ifreq is valid (a name of NULs, a zero union).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    req.ifr_ifru.ifru_ifindex = ifindex as libc::c_int;
    // SAFETY: SIOCGIFNAME reads ifr_ifindex and writes at most IFNAMSIZ
    // bytes of name into `req`, which lives for the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFNAME, &raw mut req) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENODEV) => Ok(false),
        _ => Err(e),
    }
}

fn flow_id4(k: &DpCtKey) -> crate::datapath::FlowId {
    crate::datapath::FlowId {
        sandbox_ip: Ipv4Addr::from(k.sandbox_ip.to_ne_bytes()),
        proto: k.proto,
        guest_port: u16::from_be(k.guest_port),
        remote: IpAddr::V4(Ipv4Addr::from(k.remote_ip.to_ne_bytes())),
        remote_port: u16::from_be(k.remote_port),
    }
}

fn flow_id6(k: &DpCt6Key) -> crate::datapath::FlowId {
    crate::datapath::FlowId {
        sandbox_ip: Ipv4Addr::from(k.sandbox_ip.to_ne_bytes()),
        proto: k.proto,
        guest_port: u16::from_be(k.guest_port),
        remote: IpAddr::V6(std::net::Ipv6Addr::from(k.remote_ip)),
        remote_port: u16::from_be(k.remote_port),
    }
}

/// The flow log's ends found in one pass: a TCP flow closed (an RST, or a
/// FIN each way) when the pass first sees it closed, any other flow when
/// its entry is removed (expired, or its sandbox released); each once.
struct Ends<'a> {
    ended: &'a mut StdHashMap<(crate::datapath::FlowId, u64), u64>,
    pass: u64,
    out: Vec<crate::datapath::FlowEnd>,
}

impl Ends<'_> {
    fn end(id: crate::datapath::FlowId, v: &DpCtVal, fixed6: bool) -> crate::datapath::FlowEnd {
        crate::datapath::FlowEnd {
            id,
            generation: v.generation,
            kind: v.kind,
            node_port: u16::from_be(v.nat_port),
            guest_fixed6: fixed6,
            start_ns: if v.start_ns == 0 {
                v.last_seen_ns
            } else {
                v.start_ns
            },
            last_ns: v.last_seen_ns,
            bytes_out: v.bytes_out,
            pkts_out: u64::from(v.pkts_out),
            bytes_in: v.bytes_in,
            pkts_in: u64::from(v.pkts_in),
        }
    }

    fn closed<K>(&mut self, all: &[(K, DpCtVal)], id: impl Fn(&K) -> crate::datapath::FlowId) {
        self.closed_with(all, id, |_| false);
    }

    fn closed_with<K>(
        &mut self,
        all: &[(K, DpCtVal)],
        id: impl Fn(&K) -> crate::datapath::FlowId,
        fixed6: impl Fn(&K) -> bool,
    ) {
        for (k, v) in all {
            let closed = v.state & DP_TCP_RST != 0
                || v.state & (DP_TCP_FIN_OUT | DP_TCP_FIN_IN) == DP_TCP_FIN_OUT | DP_TCP_FIN_IN;
            if !closed || v.kind == DP_CT_HOST {
                continue;
            }
            let fid = id(k);
            if self.ended.insert((fid, v.start_ns), self.pass).is_none() {
                self.out.push(Self::end(fid, v, fixed6(k)));
            }
        }
    }

    /// [`Ends::closed`] of `ct6` (`gaddr` 0 is DP_GADDR_FIXED: the guest's
    /// fixed address sent it).
    fn closed6(&mut self, all: &[(DpCt6Key, DpCtVal)]) {
        self.closed_with(all, flow_id6, |k| k.gaddr == 0);
    }

    fn removed6(&mut self, k: &DpCt6Key, v: &DpCtVal) {
        let id = flow_id6(k);
        if v.kind != DP_CT_HOST && self.ended.remove(&(id, v.start_ns)).is_none() {
            self.out.push(Self::end(id, v, k.gaddr == 0));
        }
    }

    fn removed(&mut self, id: crate::datapath::FlowId, v: &DpCtVal) {
        if v.kind != DP_CT_HOST && self.ended.remove(&(id, v.start_ns)).is_none() {
            self.out.push(Self::end(id, v, false));
        }
    }
}

/// One pass over the sandbox flow tables (`ct`, `ct6`): what is live per
/// sandbox, and which flows go (expired, or of a released sandbox).
struct FlowPass<'a> {
    /// Which generation owns each address now (read before the walk).
    owners: &'a StdHashMap<u32, u64>,
    now: u64,
    timeouts: FlowTimeouts,
    by_sandbox: StdHashMap<u32, u64>,
    seen: usize,
    snat: usize,
    removed: usize,
    stale: usize,
}

impl FlowPass<'_> {
    /// The flows of `all` to remove; `who` names a key's sandbox and
    /// protocol. Live ones are counted.
    fn doomed<K>(
        &mut self,
        all: Vec<(K, DpCtVal)>,
        who: impl Fn(&K) -> (u32, u8),
    ) -> Vec<(K, DpCtVal)> {
        self.seen += all.len();
        all.into_iter()
            .filter(|(k, v)| {
                let (sandbox, proto) = who(k);
                let limit = self.timeouts.limit(proto, v.state);
                let stale = self.owners.get(&sandbox) != Some(&v.generation);
                let expired = self.now.saturating_sub(v.last_seen_ns) > limit.as_nanos() as u64;
                if !stale && !expired {
                    *self.by_sandbox.entry(sandbox).or_default() += 1;
                    self.snat += usize::from(v.kind == DP_CT_SNAT);
                }
                stale || expired
            })
            .collect()
    }

    /// Whether a doomed flow (re-read unchanged) may go now: one of a
    /// released sandbox only if no owner of its generation attached since
    /// the owners were read (they were read before the walk). Counts it.
    fn confirm(&mut self, by_ip: &HashMap<MapData, u32, DpTap>, sandbox: u32, v: &DpCtVal) -> bool {
        if self.owners.get(&sandbox) != Some(&v.generation) {
            if by_ip
                .get(&sandbox, 0)
                .is_ok_and(|o| o.generation == v.generation)
            {
                return false;
            }
            self.stale += 1;
        }
        self.removed += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flow entry's key as the flow log names it: addresses and ports
    /// out of network order, both families.
    #[test]
    fn flow_ids_read_keys_in_network_order() {
        let k4 = DpCtKey {
            sandbox_ip: u32::from_ne_bytes([192, 168, 0, 9]),
            remote_ip: u32::from_ne_bytes([198, 51, 100, 2]),
            guest_port: 40000u16.to_be(),
            remote_port: 443u16.to_be(),
            proto: 6,
            pad: [0; 3],
        };
        let id = flow_id4(&k4);
        assert_eq!(id.sandbox_ip, Ipv4Addr::new(192, 168, 0, 9));
        assert_eq!(id.remote, IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2)));
        assert_eq!((id.guest_port, id.remote_port, id.proto), (40000, 443, 6));
        let remote: std::net::Ipv6Addr = "2001:db8::2".parse().unwrap();
        let k6 = DpCt6Key {
            sandbox_ip: u32::from_ne_bytes([192, 168, 0, 9]),
            remote_ip: remote.octets(),
            guest_port: 40001u16.to_be(),
            remote_port: 80u16.to_be(),
            proto: 6,
            gaddr: 1,
            pad: [0; 2],
        };
        let id = flow_id6(&k6);
        assert_eq!(id.remote, IpAddr::V6(remote));
        assert_eq!((id.guest_port, id.remote_port), (40001, 80));
    }

    /// The look pass's device check agrees with if_indextoname(3), and
    /// asks once per device.
    #[test]
    fn exists_checks_each_device_once() {
        let mut e = Exists::default();
        let lo = 1; // every namespace's loopback
        let none = 0x7fff_fff0;
        assert!(link_exists(lo));
        assert!(!link_exists(none));
        assert!(e.check(lo));
        assert!(!e.check(none));
        assert!(e.check(lo) && !e.check(none));
        assert_eq!(e.seen.len(), 2);
        assert!(matches!(e.sock, Some(Some(_))));
    }
}
