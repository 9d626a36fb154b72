//! Addresses learned from DNS answers (`dns_learned` for A records,
//! `dns_learned6` for AAAA): written by the resolver behind a lock of
//! their own, expiry the longest an owner was given, entries of an
//! earlier owner of the address removed.

use std::hash::Hash;
use std::net::Ipv6Addr;

use super::*;

/// A learned-address key of one family.
pub(super) trait LearnedKey: aya::Pod + Default + Eq + Hash {
    /// The key of (sandbox, `dst`) if `dst` is of this family.
    fn of(sandbox_ip: u32, dst: IpAddr) -> Option<Self>;
    fn sandbox_ip(&self) -> u32;
    fn dst(&self) -> IpAddr;
}

impl LearnedKey for DpLearnedKey {
    fn of(sandbox_ip: u32, dst: IpAddr) -> Option<Self> {
        match dst {
            IpAddr::V4(d) => Some(DpLearnedKey {
                sandbox_ip,
                dst: ip_be(d),
            }),
            IpAddr::V6(_) => None,
        }
    }
    fn sandbox_ip(&self) -> u32 {
        self.sandbox_ip
    }
    fn dst(&self) -> IpAddr {
        Ipv4Addr::from(self.dst.to_ne_bytes()).into()
    }
}

impl LearnedKey for DpLearned6Key {
    fn of(sandbox_ip: u32, dst: IpAddr) -> Option<Self> {
        match dst {
            IpAddr::V6(d) => Some(DpLearned6Key {
                sandbox_ip,
                dst: d.octets(),
            }),
            IpAddr::V4(_) => None,
        }
    }
    fn sandbox_ip(&self) -> u32 {
        self.sandbox_ip
    }
    fn dst(&self) -> IpAddr {
        Ipv6Addr::from(self.dst).into()
    }
}

/// One family's map: written behind its lock, dumped without it.
pub(super) struct Learned<K: LearnedKey> {
    map: Mutex<HashMap<MapData, K, DpLearnedVal>>,
    dump: MapData,
}

impl<K: LearnedKey> Learned<K> {
    pub(super) fn new(map: HashMap<MapData, K, DpLearnedVal>, dump: MapData) -> Self {
        Self {
            map: Mutex::new(map),
            dump,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<MapData, K, DpLearnedVal>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the addresses of this family; the others are skipped.
    fn put(
        &self,
        ip: u32,
        generation: u64,
        now: u64,
        addrs: &[(IpAddr, Duration)],
    ) -> Result<(), DatapathError> {
        let mut learned = self.lock();
        for (dst, ttl) in addrs {
            let Some(key) = K::of(ip, *dst) else {
                continue;
            };
            let mut expires_ns = now + ttl.as_nanos() as u64;
            // A later answer with a shorter TTL never cuts what an earlier
            // one of the same owner gave.
            if let Ok(old) = learned.get(&key, 0)
                && old.generation == generation
            {
                expires_ns = expires_ns.max(old.expires_ns);
            }
            let val = DpLearnedVal {
                expires_ns,
                generation,
            };
            learned
                .insert(key, val, 0)
                .map_err(|e| map_err("writing dns_learned", &e))?;
        }
        Ok(())
    }

    /// The entries of the addresses' current owners (`owners`: address →
    /// generation), into `out`; an earlier owner's are removed.
    fn list(
        &self,
        owners: &StdHashMap<u32, u64>,
        by_ip: &HashMap<MapData, u32, DpTap>,
        now: u64,
        out: &mut Vec<(Ipv4Addr, IpAddr, Duration)>,
    ) {
        // Batched dumps, without the lock (a full map is a million entries).
        let Some(all) = dump_flows::<K, DpLearnedVal>(&self.dump) else {
            return;
        };
        let mut stale = vec![];
        for (k, v) in all {
            if owners.get(&k.sandbox_ip()) != Some(&v.generation) {
                // An earlier owner's: unreachable, removed.
                stale.push(k);
                continue;
            }
            out.push((
                Ipv4Addr::from(k.sandbox_ip().to_ne_bytes()),
                k.dst(),
                Duration::from_nanos(v.expires_ns.saturating_sub(now)),
            ));
        }
        if stale.is_empty() {
            return;
        }
        let mut learned = self.lock();
        for k in &stale {
            // Only if still an earlier owner's (a lookup may have written
            // it again since the dump).
            let owner = by_ip.get(&k.sandbox_ip(), 0).ok().map(|t| t.generation);
            if learned.get(k, 0).is_ok_and(|v| Some(v.generation) != owner) {
                let _ = learned.remove(k);
            }
        }
    }

    fn remove(&self, ip: u32, addrs: &[IpAddr]) {
        let mut learned = self.lock();
        for key in addrs.iter().filter_map(|d| K::of(ip, *d)) {
            let _ = learned.remove(&key);
        }
    }
}

impl EbpfDatapath {
    pub(super) fn learn_addrs(
        &self,
        sandbox_ip: Ipv4Addr,
        addrs: &[(IpAddr, Duration)],
    ) -> Result<(), DatapathError> {
        let ip = ip_be(sandbox_ip);
        let now = monotonic_ns();
        // The owner's generation: an entry outlives neither its owner nor
        // reaches the next one of the address.
        let generation = self
            .by_ip_read
            .get(&ip, 0)
            .map_err(|e| map_err("reading by_ip (the sandbox's generation)", &e))?
            .generation;
        self.learned.put(ip, generation, now, addrs)?;
        self.learned6.put(ip, generation, now, addrs)
    }

    pub(super) fn learned_list(&self) -> Vec<(Ipv4Addr, IpAddr, Duration)> {
        let now = monotonic_ns();
        let Some(owners) = dump_flows::<u32, DpTap>(&self.by_ip_read_dump) else {
            return vec![];
        };
        let owners: StdHashMap<u32, u64> = owners
            .into_iter()
            .map(|(ip, t)| (ip, t.generation))
            .collect();
        let mut out = vec![];
        self.learned.list(&owners, &self.by_ip_read, now, &mut out);
        self.learned6.list(&owners, &self.by_ip_read, now, &mut out);
        out
    }

    pub(super) fn forget_addrs(&self, sandbox_ip: Ipv4Addr, addrs: &[IpAddr]) {
        let ip = ip_be(sandbox_ip);
        self.learned.remove(ip, addrs);
        self.learned6.remove(ip, addrs);
    }
}
