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

use super::domains::{Patterns, Verdict};
use super::spec::NetworkRecord;
use super::{Agent, off_worker};

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
}

/// What the proxy does with one connection of strict mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyDecision {
    /// Not a strict-mode sandbox's address: reset.
    Stranger,
    /// The name is allowed: dial it.
    Dial { sandbox_id: String },
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
        let same =
            |s: &Sandbox| s.id == rec.sandbox_id && s.patterns == patterns && s.strict == strict;
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
        let allowed = name.is_some_and(|n| {
            sb.patterns
                .as_ref()
                .is_none_or(|p| p.verdict(n) == Verdict::Allow)
        });
        let sandbox_id = sb.id.clone();
        if allowed {
            ProxyDecision::Dial { sandbox_id }
        } else {
            ProxyDecision::Refuse { sandbox_id }
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

impl Agent {
    /// What `dns::serve` made of the resolver's sockets, for Health.
    pub fn resolver_status(&self, status: Result<String, String>) {
        *self.egress.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    /// Health's `dns_resolver`: false when a sandbox with domain rules
    /// cannot resolve (no socket, or no upstream to forward to).
    pub(super) fn resolver_check(&self) -> (String, bool, String) {
        let with_rules = self
            .egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|s| s.patterns.is_some())
            .count();
        let status = self
            .egress
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (ok, what) = match status {
            None => (with_rules == 0, "starting".to_owned()),
            Some(Ok(at)) => (true, at),
            Some(Err(e)) => (with_rules == 0, format!("not serving: {e}")),
        };
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
        let strict = self
            .egress
            .sandboxes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|s| s.strict)
            .count();
        let status = self
            .egress
            .proxy_status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (ok, what) = match status {
            None => (strict == 0, "starting".to_owned()),
            Some(Ok(_)) if self.egress.proxy_filtered.load(Ordering::Relaxed) => (
                strict == 0,
                "the service's IP filter refuses the proxy's connections \
                 (IPAddressDeny=): add IPAddressAllow=any in a drop-in"
                    .to_owned(),
            ),
            Some(Ok(at)) => (true, at),
            Some(Err(e)) => (strict == 0, format!("not serving: {e}")),
        };
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
            self.egress.proxy_refused.fetch_add(1, Ordering::Relaxed);
            *self
                .egress
                .refused_by
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(src)
                .or_default() += 1;
            info!(
                sandbox_id = sandbox_id.as_str(),
                name = name.unwrap_or("(none)"),
                "proxy: connection reset: the name is not allowed (strict egress)"
            );
        }
        d
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
            self.egress.refused.fetch_add(1, Ordering::Relaxed);
            *self
                .egress
                .refused_by
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(src)
                .or_default() += 1;
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
