//! Domain egress (docs/egress.md): the resolver's questions to the core.
//! Which sandbox sent a query (by its address), whether its rules allow
//! the name, and what was learned for it: the datapath admits a new flow
//! of a sandbox with domain rules to an address learned for it
//! (`dns_learned`, written before the answer reaches the sandbox).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::domains::{Patterns, Verdict, is_domain_entry};
use super::spec::NetworkRecord;
use super::{Agent, off_worker};
use crate::alloc::{Ipv4Cidr, Ipv6Cidr};
use crate::policy::{AddrRules, Caps, DnsDecision, EgressPolicy, ProxyDecision};

/// How long the node's own addresses (never learned, never dialled) are
/// cached.
const LOCAL_ADDRS_MAX_AGE: Duration = Duration::from_secs(1);

/// Learned addresses kept per sandbox; beyond, the one expiring first is
/// evicted (counted). Lower on a node whose pool could hold more sandboxes
/// than `dns_learned` has room for at this many each (see
/// [`learned_cap`]).
pub const MAX_LEARNED_PER_SANDBOX: usize = 100;

/// The per-sandbox cap on learned addresses for a pool of `capacity`
/// sandboxes: [`MAX_LEARNED_PER_SANDBOX`], or less, so that every sandbox
/// at its cap still fits `dns_learned` (no tenant, nor all of them
/// together, can fill it).
pub fn learned_cap(capacity: u32) -> usize {
    let room = crate::datapath::maps::LEARNED_ENTRIES as usize / (capacity.max(1) as usize);
    room.clamp(1, MAX_LEARNED_PER_SANDBOX)
}

/// Why an answer's address is not learned for a sandbox (and not dialled
/// by the proxy), or `None` when it may be. Never: this host's own
/// addresses (`local`), the sandbox pool, and addresses no public service
/// has (unspecified, this network, loopback, link-local incl. the cloud
/// metadata address 169.254.169.254, multicast, reserved and broadcast,
/// 192.0.0.0/24, 198.18.0.0/15). Private (RFC 1918) and shared (CGNAT)
/// addresses only when an allow CIDR of the sandbox covers them; any
/// address a deny CIDR covers (other than the catch-all 0.0.0.0/0), unless
/// an allow CIDR covers it too (allow beats deny, as for CIDRs). IPv6
/// addresses (AAAA answers): [`unreachable_why6`].
pub fn unreachable_why(
    ip: IpAddr,
    cidrs: &CidrRules,
    local: &[IpAddr],
    pool: &Ipv4Cidr,
) -> Option<&'static str> {
    let why = match ip {
        IpAddr::V4(ip) => unreachable_why4(ip, cidrs, pool),
        IpAddr::V6(ip) => unreachable_why6(ip, cidrs),
    };
    why.or_else(|| local.contains(&ip).then_some("an address of this node"))
}

/// The IPv6 twin of [`unreachable_why4`], as the datapath's
/// `policy6_allows` judges: only global (2000::/3) and unique-local
/// (fc00::/7) unicast, never the guests' own link nor the prefixes that
/// embed IPv4 addresses (6to4 2002::/16, 2001::/23 with Teredo); a
/// unique-local address (the metadata address fd00:ec2::254 among them)
/// only under an allow CIDR; never one a deny CIDR other than the
/// catch-all covers, unless an allow CIDR covers it too.
/// The cloud metadata service's IPv6 address (AWS): never reached, not
/// even under an allow CIDR (`::/0` is a likely way to write "all IPv6").
const METADATA6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);

fn unreachable_why6(ip: Ipv6Addr, cidrs: &CidrRules) -> Option<&'static str> {
    let s = ip.segments();
    let ula = s[0] & 0xfe00 == 0xfc00;
    if s[0] & 0xe000 != 0x2000 && !ula {
        return Some("not global or unique-local unicast (2000::/3, fc00::/7)");
    }
    if s[0] == 0x2002 || (s[0] == 0x2001 && s[1] & 0xfe00 == 0) {
        return Some("an address embedding IPv4 (6to4 2002::/16, Teredo in 2001::/23)");
    }
    if s[..4] == [0xfd63, 0x7562, 0x6500, 0] {
        return Some("the guests' own link (fd63:7562:6500::/64)");
    }
    if ip == METADATA6 {
        return Some("the cloud metadata address fd00:ec2::254");
    }
    if cidrs.allow6.iter().any(|c| c.contains(ip)) {
        return None;
    }
    if ula {
        return Some("unique-local (fc00::/7) and no allow_out CIDR covers it");
    }
    if cidrs
        .deny6
        .iter()
        .any(|c| c.prefix_len() > 0 && c.contains(ip))
    {
        return Some("a deny_out CIDR covers it");
    }
    None
}

/// Addresses the agent never connects to for a sandbox, whatever its
/// rules: no public service has them, or they are the sandboxes' own.
fn never_dialled4(ip: Ipv4Addr, pool: &Ipv4Cidr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_unspecified() || o[0] == 0 {
        Some("'this network' (0.0.0.0/8)")
    } else if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_link_local() {
        Some("link-local (169.254.0.0/16, the metadata address among them)")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if o[0] >= 240 {
        Some("reserved or broadcast (240.0.0.0/4)")
    } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
        Some("IETF protocol assignments (192.0.0.0/24)")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("benchmarking (198.18.0.0/15)")
    } else if pool.contains(ip) {
        Some("the sandbox pool")
    } else {
        None
    }
}

/// [`never_dialled4`]'s IPv6 twin: unspecified, loopback, multicast,
/// link-local, IPv4-mapped, the guests' link (fd63:7562:6500::/64), the
/// sandboxes' node-side identities (`ipv6_pool`) and the cloud metadata
/// address fd00:ec2::254.
fn never_dialled6(ip: std::net::Ipv6Addr, pool6: &[u8; 12]) -> Option<&'static str> {
    let seg = ip.segments();
    if ip.is_unspecified() || ip.is_loopback() {
        Some("unspecified or loopback")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if ip.is_unicast_link_local() {
        Some("link-local")
    } else if ip.to_ipv4_mapped().is_some() {
        Some("an IPv4-mapped address")
    } else if seg[..4] == crate::types::GUEST_IPV6.segments()[..4] {
        Some("the guests' link")
    } else if ip.octets()[..12] == pool6[..] {
        Some("the sandboxes' IPv6 identities (ipv6_pool)")
    } else if ip == std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        Some("the cloud metadata address")
    } else {
        None
    }
}

fn unreachable_why4(ip: Ipv4Addr, cidrs: &CidrRules, pool: &Ipv4Cidr) -> Option<&'static str> {
    let never = never_dialled4(ip, pool);
    let o = ip.octets();
    if never.is_some() {
        return never;
    }
    let allowed = cidrs.allow.iter().any(|c| c.contains(ip));
    if allowed {
        return None;
    }
    if ip.is_private() {
        return Some("private (RFC 1918) and no allow_out CIDR covers it");
    }
    if o[0] == 100 && (64..128).contains(&o[1]) {
        return Some("shared (CGNAT, 100.64.0.0/10) and no allow_out CIDR covers it");
    }
    if cidrs
        .deny
        .iter()
        .any(|c| c.prefix_len() > 0 && c.contains(ip))
    {
        return Some("a deny_out CIDR covers it");
    }
    None
}

struct Sandbox {
    id: String,
    /// `None`: no domain rules.
    patterns: Option<Arc<Patterns>>,
    /// It reaches the world at large: internet access on and no catch-all
    /// deny. Only then does the resolver forward a name no allow rule
    /// names (and the proxy resolve one).
    world: bool,
    /// Strict mode (`egress_mode` "sni"): TCP to 80/443 via the proxy.
    strict: bool,
    /// Egress rules (with internet access: without, nothing goes out):
    /// TCP to 80/443 via the proxy, which intercepts these hosts.
    rules: Option<Arc<[crate::rules::EgressRule]>>,
    /// Internet access on (the datapath's `DP_F_INTERNET`).
    internet: bool,
    /// The CIDR rules, for strict mode without name rules (the proxy then
    /// dials what the CIDRs allow, as the datapath would).
    cidrs: Arc<CidrRules>,
    /// Strict mode or egress rules only (the proxy's connections): dropped
    /// when this entry is replaced or removed, so they check again whether
    /// they may go on. None for every other sandbox (a watch channel is ~400 bytes: 4 MB
    /// at 10,000 sandboxes).
    changed: Option<tokio::sync::watch::Sender<()>>,
    /// Its link's MTU: no UDP answer to it may be larger.
    mtu: u32,
    /// Its IPv6 may reach the world on a node with IPv6 egress (as
    /// `SandboxPath::ipv6_egress`): AAAA questions are forwarded for it.
    v6_out: bool,
}

/// A sandbox's CIDR rules: allow beats deny, anything else goes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CidrRules {
    allow: Vec<Ipv4Cidr>,
    deny: Vec<Ipv4Cidr>,
    allow6: Vec<Ipv6Cidr>,
    deny6: Vec<Ipv6Cidr>,
}

impl CidrRules {
    pub(super) fn from_lists(allow_out: &[String], deny_out: &[String]) -> Self {
        let pick = |l: &[String]| -> Vec<Ipv4Cidr> {
            l.iter()
                .filter(|e| !is_domain_entry(e))
                .filter_map(|e| match e.parse::<Ipv4Addr>() {
                    Ok(a) => Ipv4Cidr::new(a, 32),
                    Err(_) => e.parse().ok(),
                })
                .collect()
        };
        let mut deny = pick(deny_out);
        // The catch-all deny of either family closes both (as in the
        // datapath's keys): `::/0` denies every IPv4 address too.
        let all = <Ipv4Cidr as crate::alloc::ip::Cidr>::all();
        if deny_out.iter().any(|e| crate::types::is_catch_all(e)) && !deny.contains(&all) {
            deny.push(all);
        }
        let pick6 =
            |l: &[String]| -> Vec<Ipv6Cidr> { l.iter().filter_map(|e| e.parse().ok()).collect() };
        CidrRules {
            allow: pick(allow_out),
            deny,
            allow6: pick6(allow_out),
            deny6: pick6(deny_out),
        }
    }

    pub fn allows(&self, ip: Ipv4Addr) -> bool {
        self.allow.iter().any(|c| c.contains(ip)) || !self.deny.iter().any(|c| c.contains(ip))
    }
}

impl AddrRules for CidrRules {
    fn allows(&self, ip: Ipv4Addr) -> bool {
        CidrRules::allows(self, ip)
    }
}

/// Whether a sandbox reaches the world at large: internet access on, and
/// its deny CIDRs (`::/0` counts as `0.0.0.0/0`: see
/// [`CidrRules::from_lists`]) close less than half of the IPv4 space, or
/// its allow CIDRs open at least half again. A catch-all written as
/// pieces (`0.0.0.0/1` + `128.0.0.0/1`) closes the world as the catch-all
/// does; a few private ranges denied do not.
pub fn world_open(allow_internet_access: bool, cidrs: &CidrRules) -> bool {
    const HALF: u64 = 1 << 31;
    allow_internet_access && (covered(&cidrs.deny) < HALF || covered(&cidrs.allow) >= HALF)
}

/// How many IPv4 addresses the union of `list` holds (CIDRs either nest
/// or are disjoint: sorted by network, a CIDR inside the last kept one
/// adds nothing).
fn covered(list: &[Ipv4Cidr]) -> u64 {
    let mut spans: Vec<(u64, u64)> = list
        .iter()
        .map(|c| {
            let start = u64::from(u32::from(c.network()));
            (start, start + (1u64 << (32 - u32::from(c.prefix_len()))))
        })
        .collect();
    spans.sort();
    let (mut total, mut end) = (0, 0);
    for (s, e) in spans {
        if e > end {
            total += e - s.max(end);
            end = e;
        }
    }
    total
}

/// One learned destination: until when, and for which name.
struct Learned {
    until: Instant,
    name: String,
}

/// Learned destinations tracked by every sandbox's [`Mine`] together
/// (Capacity's learned-address fill; one process serves one node).
pub static LEARNED_TRACKED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One sandbox's learned destinations, by destination and by expiry (the
/// cap evicts the one expiring first: O(log n)).
#[derive(Default)]
struct Mine {
    by_dst: HashMap<IpAddr, Learned>,
    by_until: BTreeSet<(Instant, IpAddr)>,
}

impl Mine {
    /// Learns `dst` until `until` or later (a shorter TTL never cuts what
    /// an earlier answer gave); the expiry kept.
    fn put(&mut self, dst: IpAddr, until: Instant, name: &str) -> Instant {
        if let Some(l) = self.by_dst.get_mut(&dst) {
            if l.until >= until {
                return l.until;
            }
            self.by_until.remove(&(l.until, dst));
            l.until = until;
            l.name = name.to_owned();
        } else {
            LEARNED_TRACKED.fetch_add(1, Ordering::Relaxed);
            self.by_dst.insert(
                dst,
                Learned {
                    until,
                    name: name.to_owned(),
                },
            );
        }
        self.by_until.insert((until, dst));
        until
    }

    fn remove(&mut self, dst: IpAddr) {
        if let Some(l) = self.by_dst.remove(&dst) {
            LEARNED_TRACKED.fetch_sub(1, Ordering::Relaxed);
            self.by_until.remove(&(l.until, dst));
        }
    }

    /// Evicts the entries expiring first, none of `keep`, until at most
    /// `cap` are left.
    fn evict(&mut self, cap: usize, keep: &HashSet<IpAddr>) -> Vec<IpAddr> {
        let mut out = vec![];
        let mut skipped = vec![];
        while self.by_dst.len() > cap {
            let Some((until, dst)) = self.by_until.pop_first() else {
                break;
            };
            if keep.contains(&dst) {
                skipped.push((until, dst));
                continue;
            }
            self.by_dst.remove(&dst);
            LEARNED_TRACKED.fetch_sub(1, Ordering::Relaxed);
            out.push(dst);
        }
        self.by_until.extend(skipped);
        out
    }
}

/// The node's own addresses, cached for [`LOCAL_ADDRS_MAX_AGE`].
#[derive(Default)]
struct LocalAddrs(Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>>);

impl LocalAddrs {
    fn get(&self) -> Arc<Vec<IpAddr>> {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, a)) = c.as_ref()
            && at.elapsed() < LOCAL_ADDRS_MAX_AGE
        {
            return a.clone();
        }
        let a = Arc::new(local_addresses());
        *c = Some((Instant::now(), a.clone()));
        a
    }
}

/// The node's own addresses (every device's, both families); empty when
/// they cannot be read.
pub fn local_addresses() -> Vec<IpAddr> {
    read_local_addresses().unwrap_or_default()
}

/// The same, or the reason they cannot be read (EMFILE, ENOMEM): what
/// must not be taken for "the node has no addresses".
pub fn read_local_addresses() -> nix::Result<Vec<IpAddr>> {
    Ok(nix::ifaddrs::getifaddrs()?
        .filter_map(|a| {
            let a = a.address?;
            match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
                (Some(s), _) => Some(IpAddr::V4(s.ip())),
                (_, Some(s)) => Some(IpAddr::V6(s.ip())),
                _ => None,
            }
        })
        .collect())
}

#[derive(Default)]
pub struct Egress {
    sandboxes: RwLock<HashMap<Ipv4Addr, Sandbox>>,
    /// Per sandbox address, behind a lock of its own: one sandbox's
    /// answers never wait for another's.
    learned: RwLock<HashMap<Ipv4Addr, Arc<Mutex<Mine>>>>,
    local: LocalAddrs,
    /// Queries refused per sandbox address (reset with the network).
    refused_by: Mutex<HashMap<Ipv4Addr, u64>>,
    /// Requests through egress rules per sandbox address: sent on, refused.
    requests_by: Mutex<HashMap<Ipv4Addr, [u64; 2]>>,
    pub refused: AtomicU64,
    pub evicted: AtomicU64,
    /// Answers' addresses not learned (see [`unreachable_why`]).
    pub withheld: AtomicU64,
    /// The last write to `dns_learned` failed (since when, why): a full
    /// map, say. Cleared by the next one that succeeds.
    learn_failure: Mutex<Option<(Instant, String)>>,
    /// How forwarding to the upstream went lately.
    upstream: Mutex<UpstreamState>,
    /// Queries (and TCP connections) answered SERVFAIL (closed) at once
    /// for want of a slot within their source's share.
    pub busy: AtomicU64,
    /// The resolver's sockets: `None` until `dns::serve` ran, then where
    /// it listens (and its upstream) or why it cannot.
    status: Mutex<Option<Result<String, String>>>,
    /// The same for strict mode's proxy.
    proxy_status: Mutex<Option<Result<String, String>>>,
    /// Connections the proxy reset (no name, or a name not allowed).
    pub proxy_refused: AtomicU64,
    /// The egress gateway: the node CA's certificate (PEM) once it runs,
    /// or why it does not.
    gateway: Mutex<Option<Result<String, String>>>,
    /// Requests through egress rules: sent on, and refused (403, 421,
    /// 502).
    pub rule_forwarded: AtomicU64,
    pub rule_refused: AtomicU64,
    /// The proxy's last connection out was refused by the service's IP
    /// filter (systemd's IPAddressDeny=): EPERM from connect.
    proxy_filtered: std::sync::atomic::AtomicBool,
}

/// How forwarding to the upstream went: by queries, and by the probe
/// that asks it when no sandbox did for a while.
#[derive(Default)]
struct UpstreamState {
    last: Option<Instant>,
    /// Failures in a row, and the last one's cause.
    failures: u32,
    why: String,
    since: Option<Instant>,
}

/// Failures in a row after which Health says the upstream does not work
/// (one lost datagram is not a fault).
const UPSTREAM_FAILURES: u32 = 2;
/// How long without an exchange before the upstream is probed (while a
/// sandbox with domain rules exists).
pub const UPSTREAM_PROBE_AFTER: Duration = Duration::from_secs(10);

/// What a failed exchange with the upstream says to an operator.
fn upstream_why(e: &std::io::Error) -> String {
    match (e.raw_os_error(), e.kind()) {
        (Some(libc::EPERM), _) => "EPERM: the service's IP filter refuses it \
             (IPAddressDeny=; allow the upstream with IPAddressAllow= in a drop-in)"
            .into(),
        (_, std::io::ErrorKind::TimedOut) => "the upstream does not answer".into(),
        (_, std::io::ErrorKind::ConnectionRefused) => {
            "the upstream refuses (nothing listens there)".into()
        }
        _ => e.to_string(),
    }
}

fn v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(v) => Some(v),
        IpAddr::V6(_) => None,
    }
}

impl Egress {
    /// A network is (again) at its address, with these rules. Returns the
    /// learned destinations its new rules no longer allow (to forget).
    pub(super) fn put(&self, rec: &NetworkRecord, pool: &Ipv4Cidr) -> Vec<IpAddr> {
        let Some(ip) = v4(rec.sandbox_ip) else {
            return vec![];
        };
        let patterns = Patterns::from_lists(&rec.allow_names(), &rec.deny_out);
        let patterns = (!patterns.is_empty()).then(|| Arc::new(patterns));
        // Without internet access there is nothing to dial for it.
        let strict = !rec.egress_mode.is_dns() && rec.allow_internet_access;
        let cidrs = Arc::new(CidrRules::from_lists(&rec.allow_out, &rec.deny_out));
        let world = world_open(rec.allow_internet_access, &cidrs);
        let v6_out = rec.ipv6_open();
        let rules: Option<Arc<[crate::rules::EgressRule]>> = (!rec.egress_rules.is_empty()
            && rec.allow_internet_access)
            .then(|| rec.egress_rules.clone().into());
        let same = |s: &Sandbox| {
            s.id == rec.sandbox_id
                && s.patterns == patterns
                && s.world == world
                && s.strict == strict
                && s.rules == rules
                && s.internet == rec.allow_internet_access
                && s.cidrs == cidrs
                && s.mtu == rec.mtu
                && s.v6_out == v6_out
        };
        // Most view updates (ensure replies, fd held, Reconcile) change
        // neither: a shared lock is enough to see that.
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        if sandboxes.get(&ip).is_some_and(same) {
            return vec![];
        }
        drop(sandboxes);
        let mut sandboxes = self.sandboxes.write().unwrap_or_else(|p| p.into_inner());
        if sandboxes.get(&ip).is_some_and(same) {
            return vec![];
        }
        sandboxes.insert(
            ip,
            Sandbox {
                id: rec.sandbox_id.clone(),
                patterns: patterns.clone(),
                world,
                strict,
                changed: (strict || rules.is_some()).then(|| tokio::sync::watch::channel(()).0),
                rules,
                internet: rec.allow_internet_access,
                cidrs: cidrs.clone(),
                mtu: rec.mtu,
                v6_out,
            },
        );
        drop(sandboxes);
        let Some(mine) = self.mine(ip) else {
            return vec![];
        };
        // What the new rules refuse: the name, or the address (a deny
        // CIDR added, an allow CIDR that admitted a private address gone).
        let local = self.local.get();
        let mut mine = mine.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<IpAddr> = mine
            .by_dst
            .iter()
            .filter(|(dst, l)| {
                patterns
                    .as_ref()
                    .is_none_or(|p| p.verdict(&l.name) == Verdict::Refuse)
                    || unreachable_why(**dst, &cidrs, &local, pool).is_some()
            })
            .map(|(dst, _)| *dst)
            .collect();
        for dst in &gone {
            mine.remove(*dst);
        }
        gone
    }

    /// The learned destinations of the sandbox at `ip`, if any.
    fn mine(&self, ip: Ipv4Addr) -> Option<Arc<Mutex<Mine>>> {
        self.learned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .cloned()
    }

    /// The same, created if missing.
    fn mine_or_new(&self, ip: Ipv4Addr) -> Arc<Mutex<Mine>> {
        if let Some(m) = self.mine(ip) {
            return m;
        }
        self.learned
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(ip)
            .or_default()
            .clone()
    }

    /// The network at `ip` is gone: its learned destinations to forget.
    pub(super) fn remove(&self, ip: IpAddr, id: &str) -> Vec<IpAddr> {
        let Some(ip) = v4(ip) else {
            return vec![];
        };
        let mut sandboxes = self.sandboxes.write().unwrap_or_else(|p| p.into_inner());
        if sandboxes.get(&ip).is_none_or(|s| s.id != id) {
            return vec![];
        }
        sandboxes.remove(&ip);
        // Under the sandboxes' lock: the address's next owner starts at 0.
        self.refused_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        self.requests_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        drop(sandboxes);
        let mine = self
            .learned
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        mine.map(|m| {
            let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
            m.by_until.clear();
            LEARNED_TRACKED.fetch_sub(m.by_dst.len(), Ordering::Relaxed);
            m.by_dst.drain().map(|(d, _)| d).collect()
        })
        .unwrap_or_default()
    }

    /// What the pinned map held at start (an earlier run's answers): known
    /// again for the caps and converges. The names are not kept in the map,
    /// so a converge that changes an allow list takes these back.
    /// Entries that no answer could teach under the sandbox's current rules
    /// (learned by an older build, before the CIDRs changed) are not
    /// adopted: the reaper takes them back.
    fn restore(&self, entries: Vec<(Ipv4Addr, IpAddr, Duration)>, pool: &Ipv4Cidr) -> usize {
        let now = Instant::now();
        let with_rules: HashMap<Ipv4Addr, Arc<CidrRules>> = self
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, s)| s.patterns.is_some())
            .map(|(ip, s)| (*ip, s.cidrs.clone()))
            .collect();
        let local = self.local.get();
        let mut n = 0;
        for (sb, dst, left) in entries {
            let Some(cidrs) = with_rules.get(&sb) else {
                continue;
            };
            if unreachable_why(dst, cidrs, &local, pool).is_some() {
                continue;
            }
            let mine = self.mine_or_new(sb);
            let mut mine = mine.lock().unwrap_or_else(|p| p.into_inner());
            if !mine.by_dst.contains_key(&dst) {
                mine.put(dst, now + left, "");
                n += 1;
            }
        }
        n
    }

    /// One more refusal for the sandbox at `src`, and in `total`.
    fn count_refusal(&self, src: Ipv4Addr, total: &AtomicU64) {
        total.fetch_add(1, Ordering::Relaxed);
        *self
            .refused_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(src)
            .or_default() += 1;
    }

    /// How many sandboxes `which` selects.
    fn count_sandboxes(&self, which: impl Fn(&Sandbox) -> bool) -> usize {
        self.sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|s| which(s))
            .count()
    }

    /// Counts a request through `sandbox_id`'s rules, if that sandbox is
    /// still at `src`: decided under the sandboxes' lock, which `remove`
    /// takes first, so a released sandbox's connection in flight never
    /// counts against the address's next owner.
    fn count_request(&self, src: Ipv4Addr, sandbox_id: &str, forwarded: bool) {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        if sandboxes.get(&src).is_some_and(|s| s.id == sandbox_id) {
            self.requests_by
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(src)
                .or_default()[usize::from(!forwarded)] += 1;
        }
    }

    /// What the resolver and the gateway counted for the sandbox at `ip`.
    pub fn counts(&self, ip: IpAddr) -> super::traffic::AgentCounts {
        let [egress_requests, egress_refused] = v4(ip)
            .and_then(|ip| {
                self.requests_by
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&ip)
                    .copied()
            })
            .unwrap_or_default();
        super::traffic::AgentCounts {
            dns_refused: self.refused_by(ip),
            egress_requests,
            egress_refused,
        }
    }

    /// Queries refused for the sandbox at `ip` since the agent started.
    pub fn refused_by(&self, ip: IpAddr) -> u64 {
        let Some(ip) = v4(ip) else { return 0 };
        self.refused_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .copied()
            .unwrap_or(0)
    }

    fn decide(&self, src: Ipv4Addr, name: &str) -> DnsDecision {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        let Some(sb) = sandboxes.get(&src) else {
            return DnsDecision::Stranger;
        };
        let sandbox_id = sb.id.clone();
        match &sb.patterns {
            None if sb.world => DnsDecision::Forward,
            None => DnsDecision::Offline { sandbox_id },
            Some(p) => match p.verdict(name) {
                // A deny-only rule set lets other names through only for a
                // sandbox that reaches the world anyway.
                Verdict::Allow if sb.world || p.allowed_by_rule(name) => {
                    DnsDecision::Learn { sandbox_id }
                }
                Verdict::Allow => DnsDecision::Offline { sandbox_id },
                Verdict::Refuse => DnsDecision::Refuse { sandbox_id },
            },
        }
    }

    fn v6_out(&self, src: Ipv4Addr) -> bool {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        sandboxes.get(&src).is_some_and(|s| s.v6_out)
    }

    fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>, tls: bool) -> ProxyDecision {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        let Some((sb, tx)) = sandboxes
            .get(&src)
            .and_then(|s| s.changed.as_ref().map(|tx| (s, tx)))
        else {
            return ProxyDecision::Stranger;
        };
        let sandbox_id = sb.id.clone();
        if let Some(rules) = &sb.rules {
            match name.and_then(|n| crate::rules::rule_for(rules, n)) {
                Some(rule) if tls || rule.plain_http => {
                    return ProxyDecision::Intercept {
                        sandbox_id,
                        rule_host: rule.host.clone(),
                        changed: tx.subscribe(),
                    };
                }
                Some(rule) => {
                    return ProxyDecision::PlainRefused {
                        sandbox_id,
                        rule_host: rule.host.clone(),
                    };
                }
                // Strict mode judges the other names as without rules.
                None if sb.strict => {}
                None => {
                    return ProxyDecision::Splice {
                        sandbox_id,
                        changed: tx.subscribe(),
                    };
                }
            }
        }
        match (name, &sb.patterns) {
            (None, _) => ProxyDecision::Refuse { sandbox_id },
            (Some(n), Some(p)) if p.verdict(n) == Verdict::Refuse => {
                ProxyDecision::Refuse { sandbox_id }
            }
            // A deny-only rule set: as without name rules.
            (Some(n), Some(p)) if !sb.world && !p.allowed_by_rule(n) => {
                ProxyDecision::Refuse { sandbox_id }
            }
            // Allowed by a name rule: dialled like a learned address.
            (Some(_), Some(_)) => ProxyDecision::Dial {
                sandbox_id,
                cidrs: None,
                changed: tx.subscribe(),
            },
            // No name rules: the CIDR rules decide the address, for a
            // sandbox that reaches the world at large only: resolving a
            // name for one that does not would carry it to the upstream.
            (Some(_), None) if !sb.world => ProxyDecision::Refuse { sandbox_id },
            (Some(_), None) => ProxyDecision::Dial {
                sandbox_id,
                cidrs: Some(sb.cidrs.clone()),
                changed: tx.subscribe(),
            },
        }
    }

    /// The rule for `host` of the sandbox `sandbox_id` at `src`.
    fn rule(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        host: &str,
    ) -> Option<crate::rules::EgressRule> {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        let sb = sandboxes.get(&src).filter(|s| s.id == sandbox_id)?;
        crate::rules::rule_for(sb.rules.as_deref()?, host).cloned()
    }

    /// Whether the datapath's policy lets the sandbox `sandbox_id` at
    /// `src` reach `dst` (as `policy_allows`: internet access, then an
    /// allow CIDR, then a deny CIDR other than the catch-all refuses, then
    /// a learned address, then the catch-all), with the entry to watch,
    /// for a spliced connection of a sandbox the proxy still serves.
    fn splice_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        dst: IpAddr,
    ) -> Option<tokio::sync::watch::Receiver<()>> {
        // Read before the sandboxes' lock is taken: no learned lock is ever
        // held under it here (one lock order less to keep).
        let learned = self.mine(src).is_some_and(|m| {
            m.lock()
                .unwrap_or_else(|p| p.into_inner())
                .by_dst
                .contains_key(&dst)
        });
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        let sb = sandboxes.get(&src).filter(|s| s.id == sandbox_id)?;
        let tx = sb.changed.as_ref()?;
        if !sb.internet {
            return None;
        }
        let c = &sb.cidrs;
        let all = <Ipv4Cidr as crate::alloc::ip::Cidr>::all();
        let catch_all = c.deny.contains(&all);
        let allowed = match dst {
            IpAddr::V4(d) => {
                if c.allow.iter().any(|n| n.contains(d)) {
                    true
                } else if c.deny.iter().any(|n| *n != all && n.contains(d)) {
                    false
                } else {
                    !catch_all || learned
                }
            }
            // policy6_allows (guest6_out's test), for a sandbox whose IPv6
            // reaches the world.
            IpAddr::V6(d) => {
                let seg = d.segments();
                let ula = (seg[0] & 0xfe00) == 0xfc00;
                let world = (seg[0] >> 13) == 1
                    && seg[0] != 0x2002
                    && !(seg[0] == 0x2001 && seg[1] < 0x200);
                if !sb.v6_out || !(world || ula) {
                    false
                } else if c.allow6.iter().any(|n| n.contains(d)) {
                    true
                } else if ula || c.deny6.iter().any(|n| n.prefix_len() > 0 && n.contains(d)) {
                    false
                } else {
                    learned || !(catch_all || c.deny6.iter().any(|n| n.prefix_len() == 0))
                }
            }
        };
        allowed.then(|| tx.subscribe())
    }

    /// Records what was learned (at most `cap` addresses, deduplicated by
    /// the caller): what to write (each address with the expiry kept: the
    /// later of the earlier one and this answer's) and the destinations
    /// evicted to stay within `cap` (the ones expiring first, never one of
    /// this answer's).
    fn note(
        &self,
        src: Ipv4Addr,
        name: &str,
        addrs: &[(IpAddr, Duration)],
        cap: usize,
    ) -> (Vec<(IpAddr, Instant)>, Vec<IpAddr>) {
        let now = Instant::now();
        let mine = self.mine_or_new(src);
        let mut mine = mine.lock().unwrap_or_else(|p| p.into_inner());
        let write: Vec<(IpAddr, Instant)> = addrs
            .iter()
            .map(|(dst, ttl)| (*dst, mine.put(*dst, now + *ttl, name)))
            .collect();
        let keep: HashSet<IpAddr> = write.iter().map(|(d, _)| *d).collect();
        let evicted = mine.evict(cap, &keep);
        self.evicted
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        (write, evicted)
    }

    /// Notes how a write to `dns_learned` went (for Health).
    fn learn_outcome(&self, r: &Result<(), String>) {
        let mut f = self.learn_failure.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(()) => *f = None,
            Err(e) => {
                if f.is_none() {
                    *f = Some((Instant::now(), e.clone()));
                }
            }
        }
    }

    /// Why the proxy never splices a sandbox's connection to `ip` (the
    /// datapath would have dropped it as `node_addr`, or no public service
    /// has it), if it never does.
    fn never_spliced(&self, ip: IpAddr, pool: &Ipv4Cidr, pool6: &[u8; 12]) -> Option<&'static str> {
        let never = match ip {
            IpAddr::V4(ip) => never_dialled4(ip, pool),
            IpAddr::V6(ip) => never_dialled6(ip, pool6),
        };
        never.or_else(|| {
            self.local
                .get()
                .contains(&ip)
                .then_some("an address of this node")
        })
    }

    /// Why the sandbox at `src` may not reach `ip` through a name (see
    /// [`unreachable_why`]); `None` when it may. A stranger may reach
    /// nothing.
    fn unreachable(&self, src: Ipv4Addr, ip: IpAddr, pool: &Ipv4Cidr) -> Option<&'static str> {
        let cidrs = self
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .map(|s| s.cidrs.clone());
        let Some(cidrs) = cidrs else {
            return Some("not a sandbox's address");
        };
        unreachable_why(ip, &cidrs, &self.local.get(), pool)
    }

    /// Names of the last run for learned addresses adopted without one.
    fn apply_names(&self, names: &HashMap<(Ipv4Addr, IpAddr), String>) {
        if names.is_empty() {
            return;
        }
        let learned = self.learned.read().unwrap_or_else(|p| p.into_inner());
        for (src, mine) in learned.iter() {
            let mut m = mine.lock().unwrap_or_else(|p| p.into_inner());
            for (dst, l) in m.by_dst.iter_mut() {
                if l.name.is_empty()
                    && let Some(n) = names.get(&(*src, *dst))
                {
                    l.name = n.clone();
                }
            }
        }
    }

    /// Every learned address with its name.
    fn names(&self) -> Vec<(Ipv4Addr, IpAddr, String)> {
        let learned = self.learned.read().unwrap_or_else(|p| p.into_inner());
        let mut out = vec![];
        for (src, mine) in learned.iter() {
            let m = mine.lock().unwrap_or_else(|p| p.into_inner());
            out.extend(
                m.by_dst
                    .iter()
                    .filter(|(_, l)| !l.name.is_empty())
                    .map(|(d, l)| (*src, *d, l.name.clone())),
            );
        }
        out
    }

    /// The flow log: the name whose answer taught the sandbox at `src`
    /// the address `dst`, while it is learned (empty after a restart:
    /// see docs/flows.md).
    pub(super) fn learned_name(&self, src: Ipv4Addr, dst: IpAddr) -> Option<String> {
        let mine = self.mine(src)?;
        let m = mine.lock().unwrap_or_else(|p| p.into_inner());
        m.by_dst
            .get(&dst)
            .map(|l| l.name.clone())
            .filter(|n| !n.is_empty())
    }

    /// The flow log: whether a policy refusal of `dst` for the sandbox at
    /// `src` is for want of a name: it has name rules, and the address is
    /// one a name could have taught it (no CIDR rule refuses it).
    pub(super) fn refused_unlearned(&self, src: Ipv4Addr, dst: IpAddr, pool: &Ipv4Cidr) -> bool {
        let named = self
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .is_some_and(|s| s.patterns.is_some());
        named && self.unreachable(src, dst, pool).is_none()
    }

    /// Learned entries per sandbox address (for the reaper's comparison
    /// with the map).
    fn tracked(&self, ip: Ipv4Addr) -> HashSet<IpAddr> {
        self.mine(ip)
            .map(|m| {
                m.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .by_dst
                    .keys()
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A Health verdict on an agent socket for sandboxes (the resolver, the
/// proxy) that `needed` sandboxes depend on: its status (`None` until it
/// was bound), or `trouble` once it was bound.
fn serving(
    status: &Mutex<Option<Result<String, String>>>,
    needed: usize,
    trouble: Option<&str>,
) -> (bool, String) {
    let status = status.lock().unwrap_or_else(|p| p.into_inner()).clone();
    match (status, trouble) {
        (None, _) => (needed == 0, "starting".to_owned()),
        (Some(Ok(_)), Some(t)) => (needed == 0, t.to_owned()),
        (Some(Ok(at)), None) => (true, at),
        (Some(Err(e)), _) => (needed == 0, format!("not serving: {e}")),
    }
}

/// Health's `dns_resolver`: the resolver's sockets (`status`) and what
/// keeps it from working (`trouble`), for `with_rules` sandboxes with
/// domain rules that depend on it.
pub fn resolver_verdict(
    status: &Mutex<Option<Result<String, String>>>,
    with_rules: usize,
    trouble: Option<&str>,
    counts: &str,
) -> (String, bool, String) {
    let (ok, what) = serving(status, with_rules, trouble);
    (
        "dns_resolver".into(),
        ok,
        format!(
            "{what}; {} with domain rules ({counts})",
            super::health::count(with_rules, "sandbox", "sandboxes")
        ),
    )
}

/// Health's `egress_proxy`, for `strict` sandboxes in strict mode.
pub fn proxy_verdict(
    status: &Mutex<Option<Result<String, String>>>,
    strict: usize,
    trouble: Option<&str>,
    counts: &str,
) -> (String, bool, String) {
    let (ok, what) = serving(status, strict, trouble);
    (
        "egress_proxy".into(),
        ok,
        format!(
            "{what}; {} in strict (sni) mode or with egress rules; {counts}",
            super::health::count(strict, "sandbox", "sandboxes")
        ),
    )
}

impl Agent {
    /// What `dns::serve` made of the resolver's sockets, for Health.
    pub fn resolver_status(&self, status: Result<String, String>) {
        *self.egress.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    /// Health's `dns_resolver`: false when a sandbox with domain rules
    /// cannot resolve: no socket, no upstream to forward to, forwarding
    /// that fails (the service's IP filter, an upstream that does not
    /// answer), or learned addresses that cannot be written (a full map).
    pub(super) fn resolver_check(&self) -> (String, bool, String) {
        let with_rules = self.egress.count_sandboxes(|s| s.patterns.is_some());
        let trouble = {
            let u = self
                .egress
                .upstream
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let learn = self
                .egress
                .learn_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if u.failures >= UPSTREAM_FAILURES {
                Some(format!(
                    "forwarding fails: {} ({} times in a row, for {} s): allowed names get SERVFAIL",
                    u.why,
                    u.failures,
                    u.since.map_or(0, |s| s.elapsed().as_secs())
                ))
            } else {
                learn.as_ref().map(|(since, e)| {
                    format!(
                        "learned addresses cannot be written ({e}, for {} s): allowed names get SERVFAIL",
                        since.elapsed().as_secs()
                    )
                })
            }
        };
        let counts = format!(
            "at most {} learned addresses each; {} queries refused, {} answered SERVFAIL for \
             want of a slot, {} answers' addresses not learned (never reachable), {} learned \
             addresses evicted (per-sandbox cap)",
            learned_cap(
                self.d
                    .pool
                    .size()
                    .saturating_sub(3)
                    .min(u64::from(u32::MAX)) as u32
            ),
            self.egress.refused.load(Ordering::Relaxed),
            self.egress.busy.load(Ordering::Relaxed),
            self.egress.withheld.load(Ordering::Relaxed),
            self.egress.evicted.load(Ordering::Relaxed)
        );
        resolver_verdict(&self.egress.status, with_rules, trouble.as_deref(), &counts)
    }

    /// How an exchange with the upstream went (a forwarded query, a probe).
    pub fn upstream_outcome(&self, r: Result<(), &std::io::Error>) {
        let mut u = self
            .egress
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        u.last = Some(Instant::now());
        match r {
            Ok(()) => {
                u.failures = 0;
                u.since = None;
            }
            Err(e) => {
                u.failures += 1;
                u.why = upstream_why(e);
                u.since.get_or_insert_with(Instant::now);
            }
        }
    }

    /// Whether the upstream should be probed now: a sandbox with domain
    /// rules depends on it and nothing was exchanged with it lately (or
    /// the last exchanges failed, to see it recover).
    pub fn upstream_probe_due(&self) -> bool {
        if self.egress.count_sandboxes(|s| s.patterns.is_some()) == 0 {
            return false;
        }
        let u = self
            .egress
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        u.failures > 0 || u.last.is_none_or(|l| l.elapsed() >= UPSTREAM_PROBE_AFTER)
    }

    /// A query (or TCP connection) found no slot within its source's
    /// share and was answered at once.
    pub fn resolver_busy(&self) {
        self.egress.busy.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether `ip` is a sandbox's address.
    pub fn is_sandbox(&self, ip: Ipv4Addr) -> bool {
        self.egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&ip)
    }

    /// The MTU of the link of the sandbox at `src` (the node's default for
    /// a stranger, which is refused anyway).
    pub fn dns_udp_mtu(&self, src: Ipv4Addr) -> u32 {
        self.egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .map_or(self.cfg.mtu, |s| s.mtu)
    }

    /// What `dns::proxy::serve` made of the proxy's sockets, for Health.
    pub fn proxy_status(&self, status: Result<String, String>) {
        *self
            .egress
            .proxy_status
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    /// Health's `egress_proxy`: false when a strict-mode sandbox has no
    /// proxy to go through (its TCP to 80/443 would go nowhere).
    pub(super) fn proxy_check(&self) -> (String, bool, String) {
        let served = self.egress.count_sandboxes(|s| s.changed.is_some());
        let ruled = self.egress.count_sandboxes(|s| s.rules.is_some());
        let gateway = self.egress_gateway_error();
        let filtered = self
            .egress
            .proxy_filtered
            .load(Ordering::Relaxed)
            .then_some(
                "the service's IP filter refuses the proxy's connections \
             (IPAddressDeny=): add IPAddressAllow=any in a drop-in",
            );
        let gateway_trouble = gateway
            .as_ref()
            .filter(|_| ruled > 0)
            .map(|e| format!("the egress gateway does not run ({e})"));
        let trouble = filtered.map(str::to_owned).or(gateway_trouble);
        let counts = format!(
            "{} with egress rules; {} connections reset; {} requests through rules sent on, {} \
             refused{}",
            super::health::count(ruled, "sandbox", "sandboxes"),
            self.egress.proxy_refused.load(Ordering::Relaxed),
            self.egress.rule_forwarded.load(Ordering::Relaxed),
            self.egress.rule_refused.load(Ordering::Relaxed),
            gateway.map_or(String::new(), |e| format!(
                "; egress gateway not running: {e}"
            )),
        );
        proxy_verdict(
            &self.egress.proxy_status,
            served,
            trouble.as_deref(),
            &counts,
        )
    }

    /// What to do with a strict-mode connection from `src` that named
    /// `name` (TLS SNI or HTTP Host; `None`: it named nothing usable).
    /// A refusal is logged and counted (with the sandbox's refused names).
    pub fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>, tls: bool) -> ProxyDecision {
        let d = self.egress.proxy_decide(src, name, tls);
        if let ProxyDecision::Refuse { sandbox_id } = &d {
            self.egress.count_refusal(src, &self.egress.proxy_refused);
            info!(
                sandbox_id = sandbox_id.as_str(),
                name = name.unwrap_or("(none)"),
                "proxy: connection reset: the name is not allowed (strict egress)"
            );
        }
        d
    }

    /// After the sandbox's entry changed: whether the proxied connection
    /// from `src` to `name` at `dst` may go on (the same sandbox, still in
    /// strict mode, the name and address still allowed), and the entry to
    /// watch from now on.
    pub fn proxy_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        dst: Ipv4Addr,
    ) -> Option<tokio::sync::watch::Receiver<()>> {
        match self.egress.proxy_decide(src, Some(name), true) {
            ProxyDecision::Dial {
                sandbox_id: id,
                cidrs,
                changed,
            } if id == sandbox_id
                && cidrs.as_ref().is_none_or(|c| c.allows(dst))
                && self.name_target_refused(src, dst).is_none() =>
            {
                Some(changed)
            }
            _ => None,
        }
    }

    /// The egress gateway runs with this node CA certificate (PEM), or
    /// cannot run (why): for the CA's D-Bus property, varlink method and
    /// Health.
    pub fn set_egress_gateway(&self, status: Result<String, String>) {
        *self
            .egress
            .gateway
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    /// The node CA's certificate (PEM) guests trust for egress rules'
    /// hosts; `None` until the gateway runs.
    pub fn egress_ca_pem(&self) -> Option<String> {
        self.egress_gateway().and_then(Result::ok)
    }

    /// Why the egress gateway does not run, if it does not.
    pub fn egress_gateway_error(&self) -> Option<String> {
        self.egress_gateway().and_then(Result::err)
    }

    fn egress_gateway(&self) -> Option<Result<String, String>> {
        self.egress
            .gateway
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How the proxy's last connection out went: refused by the service's
    /// IP filter (`filtered`), or not.
    pub fn proxy_dialled(&self, filtered: bool) {
        let was = self.egress.proxy_filtered.swap(filtered, Ordering::Relaxed);
        if filtered && !was {
            warn!(
                "proxy: the service's IP filter (IPAddressDeny=) refuses connections to \
                 allowed names; strict-mode sandboxes need IPAddressAllow=any in a drop-in"
            );
        }
    }

    /// The priority the proxy's connection out for the sandbox at `src`
    /// carries: its class of the shaper when it has an egress limit (the
    /// datapath sends such packets through the shaper), so a limited
    /// sandbox's uploads through the proxy keep its limit; its downloads
    /// are shaped on its own device as everything delivered to it.
    pub fn proxy_priority(&self, src: Ipv4Addr) -> Option<u32> {
        let ifindex = self
            .views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|v| v.record.sandbox_ip == std::net::IpAddr::V4(src))
            .map(|v| v.tap_ifindex)?;
        self.datapath.egress_class(ifindex)
    }

    /// Whether `src` is a strict-mode sandbox's address (the proxy serves
    /// nobody else).
    pub fn proxy_serves(&self, src: Ipv4Addr) -> bool {
        self.egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .is_some_and(|s| s.changed.is_some())
    }

    /// The device a sandbox's query arrives on (the gateway device).
    pub fn resolver_ifindex(&self) -> u32 {
        self.gateway.ifindex
    }

    /// The address the resolver serves on: the gateway device's, which a
    /// guest reaches as its gateway (and a container as its gateway).
    pub fn resolver_address(&self) -> Ipv4Addr {
        self.d.pool.gateway()
    }

    /// The gateway device's IPv6 address, where the resolver and the proxy
    /// also serve when the node reaches sandboxes over IPv6 (a guest
    /// reaches it as fd63:7562:6500::5, or by its steered DNS, HTTP and
    /// HTTPS to the world).
    pub fn resolver_address6(&self) -> Option<std::net::Ipv6Addr> {
        self.gateway
            .pool6
            .then(|| self.d.pool6_addr(self.d.pool.gateway()))
    }

    /// The sandbox address a connection to the agent's sockets comes
    /// from: an IPv4 source as it is; a sandbox's IPv6 identity
    /// (`ipv6_pool` ‖ its address) as the address it ends with; any other
    /// IPv6 source is nobody's (0.0.0.0, a stranger).
    pub fn sandbox_source(&self, from: std::net::IpAddr) -> Ipv4Addr {
        match from {
            std::net::IpAddr::V4(a) => a,
            std::net::IpAddr::V6(a) if self.gateway.pool6 => {
                let o = a.octets();
                if o[..12] == self.d.ipv6_pool[..] {
                    Ipv4Addr::new(o[12], o[13], o[14], o[15])
                } else {
                    Ipv4Addr::UNSPECIFIED
                }
            }
            std::net::IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
        }
    }

    /// What to do with a query for `name` (lowercase, no trailing dot)
    /// from `src`.
    pub fn dns_decide(&self, src: Ipv4Addr, name: &str) -> DnsDecision {
        let d = self.egress.decide(src, name);
        match &d {
            DnsDecision::Refuse { sandbox_id } => {
                self.egress.count_refusal(src, &self.egress.refused);
                info!(
                    sandbox_id = sandbox_id.as_str(),
                    name, "dns: query refused by the sandbox's domain rules"
                );
            }
            DnsDecision::Offline { sandbox_id } => {
                self.egress.count_refusal(src, &self.egress.refused);
                // Every lookup of an offline guest (NTP, telemetry,
                // retries) would be a line: counted, logged at debug.
                debug!(
                    sandbox_id = sandbox_id.as_str(),
                    name,
                    "dns: query refused: the sandbox does not reach the world (internet access \
                     off or a catch-all deny_out) and no allow rule names this name"
                );
            }
            _ => {}
        }
        d
    }

    /// Whether the sandbox at `src` is told IPv6 addresses (AAAA answers):
    /// the node has IPv6 egress and the sandbox may use it. Any other gets
    /// NODATA, so a dual-stack client goes to IPv4 at once.
    pub fn dns_aaaa(&self, src: Ipv4Addr) -> bool {
        self.ipv6_egress() && self.egress.v6_out(src)
    }

    /// Whether NAT66 runs: the guests' IPv6 link is on and the uplink has
    /// an IPv6 address for it (and a default route).
    pub fn ipv6_egress(&self) -> bool {
        self.ipv6_link()
            && matches!(self.uplink, super::Uplink::Found { addr: Some(_), .. })
            && self.uplink6().is_some()
    }

    /// The uplink's NAT66 address now (see `Agent::uplink6`).
    pub fn uplink6(&self) -> Option<std::net::Ipv6Addr> {
        *self.uplink6.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the sandbox at `src` start flows to the answer's addresses
    /// (TTLs clamped to `dns_ttl_min`..`dns_ttl_max`): in the datapath
    /// before this returns, so before the answer is sent. Only addresses
    /// the sandbox may reach through a name ([`unreachable_why`]) are
    /// learned, at most the per-sandbox cap of them from one answer (the
    /// first ones), and exactly what is tracked is written. In the
    /// network's slot, so a release (and a next owner of the address)
    /// never interleaves: the entries are written for `sandbox_id` while it
    /// still holds `src`, or not at all.
    pub async fn dns_learn(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        addrs: &[(IpAddr, u32)],
    ) -> Result<(), String> {
        if addrs.is_empty() {
            return Ok(());
        }
        let cap = learned_cap(
            self.d
                .pool
                .size()
                .saturating_sub(3)
                .min(u64::from(u32::MAX)) as u32,
        );
        let (lo, hi) = (self.cfg.dns_ttl_min, self.cfg.dns_ttl_max);
        let mut seen = HashSet::new();
        let mut clamped: Vec<(IpAddr, Duration)> = Vec::with_capacity(addrs.len().min(cap));
        let mut withheld = 0u64;
        for (a, ttl) in addrs {
            if clamped.len() == cap {
                break;
            }
            if !seen.insert(*a) {
                continue;
            }
            if let Some(why) = self.egress.unreachable(src, *a, &self.d.pool) {
                withheld += 1;
                debug!(sandbox_id, name, address = %a, why, "dns: an answer's address not learned");
                continue;
            }
            clamped.push((*a, Duration::from_secs(u64::from((*ttl).clamp(lo, hi)))));
        }
        if withheld > 0 {
            self.egress.withheld.fetch_add(withheld, Ordering::Relaxed);
        }
        if clamped.is_empty() {
            return Ok(());
        }
        let slot = self.slot(sandbox_id);
        let guard = slot.lock().await;
        let current = guard
            .as_ref()
            .is_some_and(|n| n.rec.sandbox_ip == IpAddr::V4(src));
        let result = if current {
            let (write, evicted) = self.egress.note(src, name, &clamped, cap);
            for (d, _) in &write {
                self.dns_names.append(src, *d, name);
            }
            let now = Instant::now();
            let write: Vec<(IpAddr, Duration)> = write
                .into_iter()
                .map(|(d, until)| (d, until.saturating_duration_since(now)))
                .collect();
            let dp = self.datapath.clone();
            let r = off_worker(move || {
                if !evicted.is_empty() {
                    dp.forget(src, &evicted);
                }
                dp.learn(src, &write)
            })
            .await
            .map_err(|e| e.to_string());
            self.egress.learn_outcome(&r);
            r
        } else {
            Err("the network is gone".to_owned())
        };
        drop(guard);
        self.forget_slot(sandbox_id, slot);
        result.inspect_err(|e| {
            warn!(sandbox_ip = %src, sandbox_id, name, error = e.as_str(), "dns: learning the answer's addresses");
        })
    }

    /// Whether the sandbox at `src` may reach `ip` through a name it may
    /// resolve (the proxy dials only such addresses): `None`, or why not.
    pub fn name_target_refused(&self, src: Ipv4Addr, ip: Ipv4Addr) -> Option<&'static str> {
        self.egress.unreachable(src, ip.into(), &self.d.pool)
    }

    /// After a start: learns what the pinned `dns_learned` holds (off the
    /// start path; the map keeps working for the datapath meanwhile).
    pub(super) async fn egress_restore(&self) {
        let dp = self.datapath.clone();
        let entries = off_worker(move || dp.learned_entries()).await;
        let n = self.egress.restore(entries, &self.d.pool);
        if n > 0 {
            info!(
                entries = n,
                "dns: learned addresses of the last run adopted"
            );
        }
        // Their names, for the flow log; the file then holds just these.
        let names = self.dns_names.load();
        self.egress.apply_names(&names);
        self.dns_names.rewrite(&self.egress.names());
    }

    /// The learned names' file: flushed, and written anew once it holds
    /// many more lines than live names (the learned-address reaper's
    /// 30 s loop).
    pub(super) fn dns_names_tidy(&self) {
        self.dns_names.flush();
        let live = LEARNED_TRACKED.load(Ordering::Relaxed) as u64;
        if self.dns_names.lines() > 2 * live + 10_000 {
            self.dns_names.rewrite(&self.egress.names());
        }
    }

    /// Removes what `dns_learned` holds beyond what the agent tracks: an
    /// earlier owner's entries (at start, and those of released networks),
    /// and a live sandbox's that no answer wrote under its current rules
    /// (a sandbox without domain rules after a restart). Entries are
    /// noted before they are written, and each removal is decided under
    /// the sandbox's slot, so nothing an answer is about to rely on goes.
    pub(super) async fn egress_reap(&self) -> usize {
        let dp = self.datapath.clone();
        let entries = off_worker(move || dp.learned_entries()).await;
        let mut by_sandbox: HashMap<Ipv4Addr, Vec<IpAddr>> = HashMap::new();
        for (sb, dst, _) in entries {
            by_sandbox.entry(sb).or_default().push(dst);
        }
        let mut removed = 0;
        for (sb, dsts) in by_sandbox {
            let tracked = self.egress.tracked(sb);
            if dsts.iter().all(|d| tracked.contains(d)) {
                continue;
            }
            let id = self
                .egress
                .sandboxes
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(&sb)
                .map(|s| s.id.clone());
            let slot = id.as_deref().map(|id| self.slot(id));
            let guard = match &slot {
                Some(s) => Some(s.lock().await),
                None => None,
            };
            let tracked = self.egress.tracked(sb);
            let extra: Vec<IpAddr> = dsts.into_iter().filter(|d| !tracked.contains(d)).collect();
            removed += extra.len();
            let dp = self.datapath.clone();
            off_worker(move || dp.forget(sb, &extra)).await;
            drop(guard);
            if let (Some(id), Some(slot)) = (id, slot) {
                self.forget_slot(&id, slot);
            }
        }
        if removed > 0 {
            debug!(
                entries = removed,
                "dns: learned entries no answer accounts for removed"
            );
        }
        removed
    }

    /// Keeps the resolver's view of a network in step (`put_view`).
    pub(super) fn egress_put(&self, rec: &NetworkRecord) {
        let gone = self.egress.put(rec, &self.d.pool);
        if let (false, Some(ip)) = (gone.is_empty(), v4(rec.sandbox_ip)) {
            self.datapath.forget(ip, &gone);
        }
    }

    /// The network is gone (`remove_view`).
    pub(super) fn egress_remove(&self, rec: &NetworkRecord) {
        let gone = self.egress.remove(rec.sandbox_ip, &rec.sandbox_id);
        if let (false, Some(ip)) = (gone.is_empty(), v4(rec.sandbox_ip)) {
            self.datapath.forget(ip, &gone);
        }
    }
}

/// The resolver and the proxy (`dns/`) see the agent through this
/// interface only (see `policy.rs`); each method is the inherent one above.
impl EgressPolicy for Agent {
    fn resolver_address(&self) -> Ipv4Addr {
        Agent::resolver_address(self)
    }
    fn resolver_address6(&self) -> Option<Ipv6Addr> {
        Agent::resolver_address6(self)
    }
    fn resolver_ifindex(&self) -> u32 {
        Agent::resolver_ifindex(self)
    }
    fn socket_caps(&self) -> Caps {
        Agent::socket_caps(self)
    }
    fn resolver_status(&self, status: Result<String, String>) {
        Agent::resolver_status(self, status)
    }
    fn upstream_probe_due(&self) -> bool {
        Agent::upstream_probe_due(self)
    }
    fn upstream_outcome(&self, r: Result<(), &std::io::Error>) {
        Agent::upstream_outcome(self, r)
    }
    fn resolver_busy(&self) {
        Agent::resolver_busy(self)
    }
    fn sandbox_source(&self, from: IpAddr) -> Ipv4Addr {
        Agent::sandbox_source(self, from)
    }
    fn is_sandbox(&self, ip: Ipv4Addr) -> bool {
        Agent::is_sandbox(self, ip)
    }
    fn dns_udp_mtu(&self, src: Ipv4Addr) -> u32 {
        Agent::dns_udp_mtu(self, src)
    }
    fn dns_decide(&self, src: Ipv4Addr, name: &str) -> DnsDecision {
        Agent::dns_decide(self, src, name)
    }
    fn dns_aaaa(&self, src: Ipv4Addr) -> bool {
        Agent::dns_aaaa(self, src)
    }
    fn dns_learn(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        addrs: &[(IpAddr, u32)],
    ) -> impl Future<Output = Result<(), String>> + Send {
        Agent::dns_learn(self, src, sandbox_id, name, addrs)
    }
    fn proxy_status(&self, status: Result<String, String>) {
        Agent::proxy_status(self, status)
    }
    fn proxy_serves(&self, src: Ipv4Addr) -> bool {
        Agent::proxy_serves(self, src)
    }
    fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>, tls: bool) -> ProxyDecision {
        Agent::proxy_decide(self, src, name, tls)
    }
    fn proxy_peer(
        &self,
        local: std::net::SocketAddr,
        guest: std::net::SocketAddr,
    ) -> Option<std::net::SocketAddr> {
        self.datapath.proxy_peer(local, guest)
    }
    fn egress_rule(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        host: &str,
    ) -> Option<crate::rules::EgressRule> {
        self.egress.rule(src, sandbox_id, host)
    }
    fn egress_request(&self, src: Ipv4Addr, sandbox_id: &str, forwarded: bool) {
        let counter = if forwarded {
            &self.egress.rule_forwarded
        } else {
            &self.egress.rule_refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.egress.count_request(src, sandbox_id, forwarded);
    }
    fn splice_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        dst: IpAddr,
    ) -> Option<tokio::sync::watch::Receiver<()>> {
        if let Some(why) = self
            .egress
            .never_spliced(dst, &self.d.pool, &self.d.ipv6_pool)
        {
            info!(sandbox_id, %dst, why, "proxy: never spliced to this address; reset");
            return None;
        }
        self.egress.splice_still(src, sandbox_id, dst)
    }
    fn name_target_refused(&self, src: Ipv4Addr, ip: Ipv4Addr) -> Option<&'static str> {
        Agent::name_target_refused(self, src, ip)
    }
    fn proxy_dialled(&self, filtered: bool) {
        Agent::proxy_dialled(self, filtered)
    }
    fn proxy_priority(&self, src: Ipv4Addr) -> Option<u32> {
        Agent::proxy_priority(self, src)
    }
    fn proxy_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        dst: Ipv4Addr,
    ) -> Option<tokio::sync::watch::Receiver<()>> {
        Agent::proxy_still(self, src, sandbox_id, name, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruled(
        allow: &[&str],
        deny: &[&str],
        internet: bool,
        rules: &[(&str, bool)],
    ) -> NetworkRecord {
        let rules: Vec<serde_json::Value> = rules
            .iter()
            .map(|(h, plain)| {
                serde_json::json!({"host": h, "set_headers": {"authorization": "s3cret"},
                                   "plain_http": plain})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "version": super::super::spec::RECORD_VERSION, "sandbox_id": "sb", "network_handle": "h",
            "sandbox_ip": "10.96.0.2", "tap_name": "t", "mtu": 1500, "port_mappings": [],
            "allow_internet_access": internet, "allow_out": allow, "deny_out": deny,
            "metadata": {}, "created_unix": 0, "egress_rules": rules,
        }))
        .unwrap()
    }

    #[test]
    fn egress_rules_decide_intercept_refuse_or_splice() {
        let pool: Ipv4Cidr = "10.96.0.0/16".parse().unwrap();
        let src = Ipv4Addr::new(10, 96, 0, 2);
        let e = Egress::default();
        e.put(
            &ruled(
                &[],
                &[],
                true,
                &[("api.test", false), ("*.plain.test", true)],
            ),
            &pool,
        );
        let kind = |name: Option<&str>, tls: bool| match e.proxy_decide(src, name, tls) {
            ProxyDecision::Intercept { rule_host, .. } => format!("intercept {rule_host}"),
            ProxyDecision::PlainRefused { rule_host, .. } => format!("403 {rule_host}"),
            ProxyDecision::Splice { .. } => "splice".into(),
            ProxyDecision::Dial { .. } => "dial".into(),
            ProxyDecision::Refuse { .. } => "refuse".into(),
            ProxyDecision::Stranger => "stranger".into(),
        };
        assert_eq!(kind(Some("api.test"), true), "intercept api.test");
        assert_eq!(kind(Some("api.test"), false), "403 api.test");
        assert_eq!(kind(Some("x.plain.test"), false), "intercept *.plain.test");
        assert_eq!(kind(Some("other.test"), true), "splice");
        assert_eq!(kind(None, true), "splice");
        assert!(matches!(
            e.proxy_decide(Ipv4Addr::new(10, 96, 0, 3), Some("api.test"), true),
            ProxyDecision::Stranger
        ));
        // The rule of the moment, for that sandbox only.
        assert!(e.rule(src, "sb", "api.test").is_some());
        assert!(e.rule(src, "another", "api.test").is_none());
        assert!(e.rule(src, "sb", "other.test").is_none());
        // Without internet access nothing is served.
        let e = Egress::default();
        e.put(&ruled(&[], &[], false, &[("api.test", false)]), &pool);
        assert!(matches!(
            e.proxy_decide(src, Some("api.test"), true),
            ProxyDecision::Stranger
        ));
    }

    #[test]
    fn a_splice_follows_the_datapaths_policy() {
        const P6: [u8; 12] = [0xfd, 0x63, 0x75, 0x62, 0x65, 0x01, 0, 0, 0, 0, 0, 0];
        let pool: Ipv4Cidr = "10.96.0.0/16".parse().unwrap();
        let src = Ipv4Addr::new(10, 96, 0, 2);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // Open to the world but for a deny CIDR.
        let e = Egress::default();
        e.put(
            &ruled(&[], &["203.0.113.0/24"], true, &[("api.test", false)]),
            &pool,
        );
        assert!(e.splice_still(src, "sb", ip("198.51.100.7")).is_some());
        assert!(e.splice_still(src, "sb", ip("203.0.113.9")).is_none());
        assert!(e.splice_still(src, "other", ip("198.51.100.7")).is_none());
        // Only names: the catch-all refuses what was not learned; an allow
        // CIDR opens its addresses. The rules' hosts join the allow names.
        let e = Egress::default();
        let rec = ruled(
            &["198.51.100.0/28"],
            &["0.0.0.0/0"],
            true,
            &[("api.test", false)],
        );
        assert!(rec.rule_names() && rec.allow_names().contains(&"api.test".to_string()));
        e.put(&rec, &pool);
        assert!(e.splice_still(src, "sb", ip("198.51.100.7")).is_some());
        assert!(e.splice_still(src, "sb", ip("192.0.2.80")).is_none());
        e.note(
            src,
            "api.test",
            &[(ip("192.0.2.80"), Duration::from_secs(60))],
            10,
        );
        assert!(e.splice_still(src, "sb", ip("192.0.2.80")).is_some());
        // Open to the world with no allow names: the hosts stay out of the
        // names (adding one would close every other name).
        let rec = ruled(&[], &[], true, &[("api.test", false)]);
        assert!(!rec.rule_names());
        // IPv6 (guest6_out's test): the world, not a ULA nor 6to4, for a
        // sandbox whose IPv6 reaches the world.
        let e = Egress::default();
        e.put(&rec, &pool);
        assert!(e.splice_still(src, "sb", ip("2606:4700::1")).is_some());
        for no in ["fd12::1", "2002:c000:204::1", "2001:0:1::1"] {
            assert!(e.splice_still(src, "sb", ip(no)).is_none(), "{no}");
        }
        let closed = ruled(
            &["198.51.100.0/28"],
            &["0.0.0.0/0"],
            true,
            &[("api.test", false)],
        );
        let e6 = Egress::default();
        e6.put(&closed, &pool);
        assert!(e6.splice_still(src, "sb", ip("2606:4700::1")).is_none());
        // Never the node's or no public service's.
        assert!(e.never_spliced(ip("127.0.0.1"), &pool, &P6).is_some());
        assert!(e.never_spliced(ip("10.96.0.9"), &pool, &P6).is_some());
        assert!(e.never_spliced(ip("169.254.169.254"), &pool, &P6).is_some());
        assert!(e.never_spliced(ip("198.51.100.7"), &pool, &P6).is_none());
        for no in [
            "::1",
            "fe80::1",
            "fd63:7562:6500::6",
            "fd63:7562:6501::a60:2",
            "fd00:ec2::254",
            "::ffff:10.0.0.1",
        ] {
            assert!(e.never_spliced(ip(no), &pool, &P6).is_some(), "{no}");
        }
        assert!(e.never_spliced(ip("2606:4700::1"), &pool, &P6).is_none());
    }

    #[test]
    fn the_world_is_closed_by_half_the_space_denied() {
        let w = |allow: &[&str], deny: &[&str]| {
            let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            world_open(true, &CidrRules::from_lists(&v(allow), &v(deny)))
        };
        assert!(w(&[], &[]));
        assert!(w(&[], &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]));
        assert!(!w(&[], &["0.0.0.0/0"]));
        assert!(!w(&[], &["::/0"]));
        assert!(!w(&[], &["0.0.0.0/1", "128.0.0.0/1"]));
        assert!(!w(&["198.51.100.0/24"], &["0.0.0.0/0"]));
        assert!(w(&["0.0.0.0/0"], &["0.0.0.0/0"]));
        assert!(!world_open(false, &CidrRules::default()));
        assert_eq!(covered(&[]), 0);
    }

    #[test]
    fn the_catch_all_deny_of_either_family_closes_ipv4_for_the_proxy() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let dst = Ipv4Addr::new(203, 0, 113, 7);
        for all in ["0.0.0.0/0", "::/0"] {
            let r = CidrRules::from_lists(&l(&["198.51.100.0/24"]), &l(&[all]));
            assert!(!r.allows(dst), "{all}");
            assert!(r.allows(Ipv4Addr::new(198, 51, 100, 2)), "{all}");
        }
        // IPv6 CIDRs say nothing about IPv4 addresses.
        let r = CidrRules::from_lists(&l(&["2001:db8::/32"]), &l(&["2001:db8:1::/48"]));
        assert!(r.allows(dst));
    }
}
