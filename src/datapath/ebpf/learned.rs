//! Addresses learned from DNS answers (`dns_learned`): written by the
//! resolver behind a lock of their own, expiry the longest an owner was
//! given, entries of an earlier owner of the address removed.

use super::*;

impl EbpfDatapath {
    pub(super) fn learn_addrs(
        &self,
        sandbox_ip: Ipv4Addr,
        addrs: &[(Ipv4Addr, Duration)],
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
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        for (dst, ttl) in addrs {
            let key = DpLearnedKey {
                sandbox_ip: ip,
                dst: ip_be(*dst),
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

    pub(super) fn learned_list(&self) -> Vec<(Ipv4Addr, Ipv4Addr, Duration)> {
        // Batched dumps, without the lock `attach` needs (a full map is a
        // million entries).
        let now = monotonic_ns();
        let Some(all) = dump_flows::<DpLearnedKey, DpLearnedVal>(&self.learned_dump) else {
            return vec![];
        };
        let Some(owners) = dump_flows::<u32, DpTap>(&self.by_ip_read_dump) else {
            return vec![];
        };
        let owners: StdHashMap<u32, u64> = owners
            .into_iter()
            .map(|(ip, t)| (ip, t.generation))
            .collect();
        let mut out = Vec::with_capacity(all.len());
        let mut stale = vec![];
        for (k, v) in all {
            if owners.get(&k.sandbox_ip) != Some(&v.generation) {
                // An earlier owner's: unreachable, removed.
                stale.push(k);
                continue;
            }
            out.push((
                Ipv4Addr::from(k.sandbox_ip.to_ne_bytes()),
                Ipv4Addr::from(k.dst.to_ne_bytes()),
                Duration::from_nanos(v.expires_ns.saturating_sub(now)),
            ));
        }
        if !stale.is_empty() {
            let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
            for k in &stale {
                // Only if still an earlier owner's (a lookup may have
                // written it again since the dump).
                let owner = self
                    .by_ip_read
                    .get(&k.sandbox_ip, 0)
                    .ok()
                    .map(|t| t.generation);
                if learned.get(k, 0).is_ok_and(|v| Some(v.generation) != owner) {
                    let _ = learned.remove(k);
                }
            }
        }
        out
    }

    pub(super) fn forget_addrs(&self, sandbox_ip: Ipv4Addr, addrs: &[Ipv4Addr]) {
        let ip = ip_be(sandbox_ip);
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        for dst in addrs {
            let _ = learned.remove(&DpLearnedKey {
                sandbox_ip: ip,
                dst: ip_be(*dst),
            });
        }
    }
}
