//! Domain egress (docs/egress.md): the resolver's questions to the core.
//! Which sandbox sent a query (by its address), whether its rules allow
//! the name, and what was learned for it: the datapath admits a new flow
//! of a sandbox with domain rules to an address learned for it
//! (`dns_learned`, written before the answer reaches the sandbox).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::domains::{Patterns, Verdict, is_domain_entry};
use super::spec::NetworkRecord;
use super::{Agent, off_worker};
use crate::alloc::Ipv4Cidr;

/// Learned addresses kept per sandbox; beyond, the one expiring first is
/// evicted (counted).
pub const MAX_LEARNED_PER_SANDBOX: usize = 100;

/// What the resolver does with one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsDecision {
    /// Not a sandbox's address: REFUSED.
    Stranger,
    /// A sandbox without domain rules: forwarded, nothing learned.
    Forward,
    /// Allowed by the sandbox's patterns: forwarded, answers learned.
    Learn { sandbox_id: String },
    /// Not allowed: REFUSED (logged and counted).
    Refuse { sandbox_id: String },
}

struct Sandbox {
    id: String,
    /// `None`: no domain rules.
    patterns: Option<Arc<Patterns>>,
    /// Strict mode (`egress_mode` "sni"): TCP to 80/443 via the proxy.
    strict: bool,
    /// The CIDR rules, for strict mode without name rules (the proxy then
    /// dials what the CIDRs allow, as the datapath would).
    cidrs: Arc<CidrRules>,
    /// Dropped when this entry is replaced or removed: the proxy's
    /// connections of the sandbox check again whether they may go on.
    changed: tokio::sync::watch::Sender<()>,
}

/// A sandbox's CIDR rules: allow beats deny, anything else goes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CidrRules {
    allow: Vec<Ipv4Cidr>,
    deny: Vec<Ipv4Cidr>,
}

impl CidrRules {
    fn from_lists(allow_out: &[String], deny_out: &[String]) -> Self {
        let pick = |l: &[String]| -> Vec<Ipv4Cidr> {
            l.iter()
                .filter(|e| !is_domain_entry(e))
                .filter_map(|e| match e.parse::<Ipv4Addr>() {
                    Ok(a) => Ipv4Cidr::new(a, 32),
                    Err(_) => e.parse().ok(),
                })
                .collect()
        };
        CidrRules {
            allow: pick(allow_out),
            deny: pick(deny_out),
        }
    }

    pub fn allows(&self, ip: Ipv4Addr) -> bool {
        self.allow.iter().any(|c| c.contains(ip)) || !self.deny.iter().any(|c| c.contains(ip))
    }
}

/// What the proxy does with one connection of strict mode.
#[derive(Debug)]
pub enum ProxyDecision {
    /// Not a strict-mode sandbox's address: reset.
    Stranger,
    /// The name is allowed: dial it (an address `cidrs` allows, when no
    /// name rule allowed it), until `changed` says the sandbox's rules
    /// changed.
    Dial {
        sandbox_id: String,
        cidrs: Option<Arc<CidrRules>>,
        changed: tokio::sync::watch::Receiver<()>,
    },
    /// Not allowed (or no name): reset (logged and counted).
    Refuse { sandbox_id: String },
}

/// One learned destination: until when, and for which name.
struct Learned {
    until: Instant,
    name: String,
}

#[derive(Default)]
pub struct Egress {
    sandboxes: RwLock<HashMap<Ipv4Addr, Sandbox>>,
    learned: Mutex<HashMap<Ipv4Addr, HashMap<Ipv4Addr, Learned>>>,
    /// Queries refused per sandbox address (reset with the network).
    refused_by: Mutex<HashMap<Ipv4Addr, u64>>,
    pub refused: AtomicU64,
    pub evicted: AtomicU64,
    /// The resolver's sockets: `None` until `dns::serve` ran, then where
    /// it listens (and its upstream) or why it cannot.
    status: Mutex<Option<Result<String, String>>>,
    /// The same for strict mode's proxy.
    proxy_status: Mutex<Option<Result<String, String>>>,
    /// Connections the proxy reset (no name, or a name not allowed).
    pub proxy_refused: AtomicU64,
    /// The proxy's last connection out was refused by the service's IP
    /// filter (systemd's IPAddressDeny=): EPERM from connect.
    proxy_filtered: std::sync::atomic::AtomicBool,
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
    pub(super) fn put(&self, rec: &NetworkRecord) -> Vec<Ipv4Addr> {
        let Some(ip) = v4(rec.sandbox_ip) else {
            return vec![];
        };
        let patterns = Patterns::from_lists(&rec.allow_out, &rec.deny_out);
        let patterns = (!patterns.is_empty()).then(|| Arc::new(patterns));
        // Without internet access there is nothing to dial for it.
        let strict = !rec.egress_mode.is_dns() && rec.allow_internet_access;
        let cidrs = Arc::new(CidrRules::from_lists(&rec.allow_out, &rec.deny_out));
        let same = |s: &Sandbox| {
            s.id == rec.sandbox_id
                && s.patterns == patterns
                && s.strict == strict
                && s.cidrs == cidrs
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
                strict,
                cidrs,
                changed: tokio::sync::watch::channel(()).0,
            },
        );
        drop(sandboxes);
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mine) = learned.get_mut(&ip) else {
            return vec![];
        };
        let gone: Vec<Ipv4Addr> = mine
            .iter()
            .filter(|(_, l)| {
                patterns
                    .as_ref()
                    .is_none_or(|p| p.verdict(&l.name) == Verdict::Refuse)
            })
            .map(|(dst, _)| *dst)
            .collect();
        for dst in &gone {
            mine.remove(dst);
        }
        gone
    }

    /// The network at `ip` is gone: its learned destinations to forget.
    pub(super) fn remove(&self, ip: IpAddr, id: &str) -> Vec<Ipv4Addr> {
        let Some(ip) = v4(ip) else {
            return vec![];
        };
        let mut sandboxes = self.sandboxes.write().unwrap_or_else(|p| p.into_inner());
        if sandboxes.get(&ip).is_none_or(|s| s.id != id) {
            return vec![];
        }
        sandboxes.remove(&ip);
        drop(sandboxes);
        self.refused_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        learned
            .remove(&ip)
            .map(|m| m.into_keys().collect())
            .unwrap_or_default()
    }

    /// What the pinned map held at start (an earlier run's answers): known
    /// again for the caps and converges. The names are not kept in the map,
    /// so a converge that changes an allow list takes these back.
    fn restore(&self, entries: Vec<(Ipv4Addr, Ipv4Addr, Duration)>) -> usize {
        let now = Instant::now();
        let with_rules: std::collections::HashSet<Ipv4Addr> = self
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, s)| s.patterns.is_some())
            .map(|(ip, _)| *ip)
            .collect();
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for (sb, dst, left) in entries {
            if !with_rules.contains(&sb) {
                continue;
            }
            learned
                .entry(sb)
                .or_default()
                .entry(dst)
                .or_insert_with(|| {
                    n += 1;
                    Learned {
                        until: now + left,
                        name: String::new(),
                    }
                });
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
        match &sb.patterns {
            None => DnsDecision::Forward,
            Some(p) => match p.verdict(name) {
                Verdict::Allow => DnsDecision::Learn {
                    sandbox_id: sb.id.clone(),
                },
                Verdict::Refuse => DnsDecision::Refuse {
                    sandbox_id: sb.id.clone(),
                },
            },
        }
    }

    fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>) -> ProxyDecision {
        let sandboxes = self.sandboxes.read().unwrap_or_else(|p| p.into_inner());
        let Some(sb) = sandboxes.get(&src).filter(|s| s.strict) else {
            return ProxyDecision::Stranger;
        };
        let sandbox_id = sb.id.clone();
        match (name, &sb.patterns) {
            (None, _) => ProxyDecision::Refuse { sandbox_id },
            (Some(n), Some(p)) if p.verdict(n) == Verdict::Refuse => {
                ProxyDecision::Refuse { sandbox_id }
            }
            // Allowed by a name rule: dialled like a learned address.
            (Some(_), Some(_)) => ProxyDecision::Dial {
                sandbox_id,
                cidrs: None,
                changed: sb.changed.subscribe(),
            },
            // No name rules: the CIDR rules decide the address.
            (Some(_), None) => ProxyDecision::Dial {
                sandbox_id,
                cidrs: Some(sb.cidrs.clone()),
                changed: sb.changed.subscribe(),
            },
        }
    }

    /// Records what was learned; returns the destinations evicted to stay
    /// within [`MAX_LEARNED_PER_SANDBOX`].
    fn note(&self, src: Ipv4Addr, name: &str, addrs: &[(Ipv4Addr, Duration)]) -> Vec<Ipv4Addr> {
        let now = Instant::now();
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        let mine = learned.entry(src).or_default();
        for (dst, ttl) in addrs {
            let until = now + *ttl;
            let e = mine.entry(*dst).or_insert_with(|| Learned {
                until,
                name: name.to_owned(),
            });
            if e.until <= until {
                e.until = until;
                e.name = name.to_owned();
            }
        }
        let mut evicted = vec![];
        while mine.len() > MAX_LEARNED_PER_SANDBOX {
            let Some(first) = mine.iter().min_by_key(|(_, l)| l.until).map(|(d, _)| *d) else {
                break;
            };
            mine.remove(&first);
            evicted.push(first);
        }
        self.evicted
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        evicted
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

impl Agent {
    /// What `dns::serve` made of the resolver's sockets, for Health.
    pub fn resolver_status(&self, status: Result<String, String>) {
        *self.egress.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    /// Health's `dns_resolver`: false when a sandbox with domain rules
    /// cannot resolve (no socket, or no upstream to forward to).
    pub(super) fn resolver_check(&self) -> (String, bool, String) {
        let with_rules = self.egress.count_sandboxes(|s| s.patterns.is_some());
        let (ok, what) = serving(&self.egress.status, with_rules, None);
        let detail = format!(
            "{what}; {with_rules} sandboxes with domain rules; {} queries refused, {} learned addresses evicted (per-sandbox cap)",
            self.egress.refused.load(Ordering::Relaxed),
            self.egress.evicted.load(Ordering::Relaxed)
        );
        ("dns_resolver".into(), ok, detail)
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
        let strict = self.egress.count_sandboxes(|s| s.strict);
        let filtered = self
            .egress
            .proxy_filtered
            .load(Ordering::Relaxed)
            .then_some(
                "the service's IP filter refuses the proxy's connections \
             (IPAddressDeny=): add IPAddressAllow=any in a drop-in",
            );
        let (ok, what) = serving(&self.egress.proxy_status, strict, filtered);
        let detail = format!(
            "{what}; {strict} sandboxes in strict (sni) mode; {} connections reset",
            self.egress.proxy_refused.load(Ordering::Relaxed)
        );
        ("egress_proxy".into(), ok, detail)
    }

    /// What to do with a strict-mode connection from `src` that named
    /// `name` (TLS SNI or HTTP Host; `None`: it named nothing usable).
    /// A refusal is logged and counted (with the sandbox's refused names).
    pub fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>) -> ProxyDecision {
        let d = self.egress.proxy_decide(src, name);
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
        match self.egress.proxy_decide(src, Some(name)) {
            ProxyDecision::Dial {
                sandbox_id: id,
                cidrs,
                changed,
            } if id == sandbox_id && cidrs.as_ref().is_none_or(|c| c.allows(dst)) => Some(changed),
            _ => None,
        }
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

    /// Whether `src` is a strict-mode sandbox's address (the proxy serves
    /// nobody else).
    pub fn proxy_serves(&self, src: Ipv4Addr) -> bool {
        self.egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src)
            .is_some_and(|s| s.strict)
    }

    /// The agent's own pool: never a destination the proxy dials.
    pub fn pool_contains(&self, ip: Ipv4Addr) -> bool {
        self.d.pool.contains(ip)
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

    /// What to do with a query for `name` (lowercase, no trailing dot)
    /// from `src`.
    pub fn dns_decide(&self, src: Ipv4Addr, name: &str) -> DnsDecision {
        let d = self.egress.decide(src, name);
        if let DnsDecision::Refuse { sandbox_id } = &d {
            self.egress.count_refusal(src, &self.egress.refused);
            info!(
                sandbox_id = sandbox_id.as_str(),
                name, "dns: query refused by the sandbox's domain rules"
            );
        }
        d
    }

    /// Lets the sandbox at `src` start flows to the answer's addresses
    /// (TTLs clamped to `dns_ttl_min`..`dns_ttl_max`): in the datapath
    /// before this returns, so before the answer is sent. In the network's
    /// slot, so a release (and a next owner of the address) never
    /// interleaves: the entries are written for `sandbox_id` while it still
    /// holds `src`, or not at all.
    pub async fn dns_learn(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        addrs: &[(Ipv4Addr, u32)],
    ) -> Result<(), String> {
        if addrs.is_empty() {
            return Ok(());
        }
        let (lo, hi) = (self.cfg.dns_ttl_min, self.cfg.dns_ttl_max);
        let clamped: Vec<(Ipv4Addr, Duration)> = addrs
            .iter()
            .map(|(a, ttl)| (*a, Duration::from_secs(u64::from((*ttl).clamp(lo, hi)))))
            .collect();
        let slot = self.slot(sandbox_id);
        let guard = slot.lock().await;
        let current = guard
            .as_ref()
            .is_some_and(|n| n.rec.sandbox_ip == IpAddr::V4(src));
        let result = if current {
            let evicted = self.egress.note(src, name, &clamped);
            let dp = self.datapath.clone();
            off_worker(move || {
                if !evicted.is_empty() {
                    dp.forget(src, &evicted);
                }
                dp.learn(src, &clamped)
            })
            .await
            .map_err(|e| e.to_string())
        } else {
            Err("the network is gone".to_owned())
        };
        drop(guard);
        self.forget_slot(sandbox_id, slot);
        result.inspect_err(|e| {
            warn!(sandbox_ip = %src, sandbox_id, name, error = e.as_str(), "dns: learning the answer's addresses");
        })
    }

    /// After a start: learns what the pinned `dns_learned` holds (off the
    /// start path; the map keeps working for the datapath meanwhile).
    pub(super) async fn egress_restore(&self) {
        let dp = self.datapath.clone();
        let entries = off_worker(move || dp.learned_entries()).await;
        let n = self.egress.restore(entries);
        if n > 0 {
            info!(
                entries = n,
                "dns: learned addresses of the last run adopted"
            );
        }
    }

    /// Keeps the resolver's view of a network in step (`put_view`).
    pub(super) fn egress_put(&self, rec: &NetworkRecord) {
        let gone = self.egress.put(rec);
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
