//! The sandboxes' CIDR rules in the policy tries of both families
//! (`policy_allow`/`policy_deny`, `policy6_allow`/`policy6_deny`): the keys
//! a sandbox's lists want, and which ones each sandbox has, written with
//! its other entries (journalled) and removed on release.

use std::hash::Hash;

use super::*;
use crate::alloc::ip::Cidr;
use crate::alloc::{Ipv4Cidr, Ipv6Cidr};
use crate::types::is_catch_all;

/// A policy key's data: the sandbox's address, then the destination.
pub(super) trait PolicyData: aya::Pod + Eq + Hash {
    fn sandbox_ip(&self) -> u32;
}

impl PolicyData for DpPolicyData {
    fn sandbox_ip(&self) -> u32 {
        self.sandbox_ip
    }
}

impl PolicyData for DpPolicy6Data {
    fn sandbox_ip(&self) -> u32 {
        self.sandbox_ip
    }
}

/// A key as a comparable value (aya's `Key` is packed, no `Eq`).
type Id<K> = (u32, K);

fn id<K: PolicyData>(k: &Key<K>) -> Id<K> {
    (k.prefix_len(), k.data())
}

/// (allow, deny) keys of one sandbox.
pub(super) type Wanted<K> = (Vec<Key<K>>, Vec<Key<K>>);

/// A key one attach added: removed again on rollback.
pub(super) enum Added<K: PolicyData> {
    Allow(Key<K>),
    Deny(Key<K>),
}

/// A deny key's value: the catch-all (0.0.0.0/0, ::/0: "anything not
/// allowed") is the one deny a learned address passes; every other deny
/// CIDR beats it (`policy_allows`).
pub(super) fn deny_value<K: PolicyData>(k: &Key<K>) -> u8 {
    if k.prefix_len() == 32 {
        DP_DENY_CATCH_ALL
    } else {
        DP_DENY_BEATS_LEARNED
    }
}

/// The keys of one family of a normalised list (the other family's
/// entries and names skipped), `data` the key of one CIDR; `deny`: the
/// other family's catch-all counts as this one's (`is_catch_all`). Allow
/// CIDRs stay in their family: `allow_out` ::/0 opens no IPv4 private
/// range, 0.0.0.0/0 no IPv6 unique-local one.
fn keys<C: Cidr, K: PolicyData>(
    list: &[String],
    deny: bool,
    data: impl Fn(&C) -> K,
) -> Vec<Key<K>> {
    let mut cidrs: Vec<C> = list.iter().filter_map(|c| c.parse().ok()).collect();
    if deny && list.iter().any(|e| is_catch_all(e)) && !cidrs.contains(&C::all()) {
        cidrs.push(C::all());
    }
    cidrs
        .iter()
        .map(|c| Key::new(32 + u32::from(c.prefix_len()), data(c)))
        .collect()
}

/// `policy_allow`/`policy_deny` keys of sandbox `ip` (see [`keys`]).
pub(super) fn keys4(ip: u32, list: &[String], deny: bool) -> Vec<Key<DpPolicyData>> {
    keys(list, deny, |c: &Ipv4Cidr| DpPolicyData {
        sandbox_ip: ip,
        dst: ip_be(c.network()),
    })
}

/// `policy6_allow`/`policy6_deny` keys of sandbox `ip` (see [`keys`]).
pub(super) fn keys6(ip: u32, list: &[String], deny: bool) -> Vec<Key<DpPolicy6Data>> {
    keys(list, deny, |c: &Ipv6Cidr| DpPolicy6Data {
        sandbox_ip: ip,
        dst: c.network().octets(),
    })
}

/// One family's tries, and the keys each sandbox with rules has in them
/// (an LPM `get` is a longest-prefix match: the index, not the map, says
/// which keys exist).
pub(super) struct Policies<K: PolicyData> {
    allow: LpmTrie<MapData, K, u8>,
    deny: LpmTrie<MapData, K, u8>,
    installed: StdHashMap<u32, Wanted<K>>,
    /// What a failed write says (naming the map: an operator's first
    /// question when one is full).
    writing: [&'static str; 2],
}

impl<K: PolicyData> Policies<K> {
    /// Takes the tries (pinned ones keep their entries) and indexes them.
    /// Deny values follow from the key (an older build wrote 1, the
    /// catch-all's, for every deny): rewritten before this build's
    /// programs run, so no learned address ever passes a narrow deny.
    pub(super) fn new(
        (allow, mut deny): (LpmTrie<MapData, K, u8>, LpmTrie<MapData, K, u8>),
        writing: [&'static str; 2],
    ) -> Result<Self, DatapathError> {
        let mut installed: StdHashMap<u32, Wanted<K>> = StdHashMap::new();
        for k in allow.keys().flatten() {
            installed
                .entry(k.data().sandbox_ip())
                .or_default()
                .0
                .push(k);
        }
        for k in deny.keys().flatten() {
            installed
                .entry(k.data().sandbox_ip())
                .or_default()
                .1
                .push(k);
        }
        for keys in installed.values() {
            for k in &keys.1 {
                let value = deny_value(k);
                if deny.get(k, 0).ok() != Some(value) {
                    deny.insert(k, value, 0)
                        .map_err(|e| map_err(writing[1], &e))?;
                }
            }
        }
        Ok(Self {
            allow,
            deny,
            installed,
            writing,
        })
    }

    /// Writes the keys the sandbox wants and does not have yet, each one
    /// pushed to the journal (`undo` wraps it) before the next write.
    pub(super) fn write<U>(
        &mut self,
        ip: u32,
        (want_allow, want_deny): (&[Key<K>], &[Key<K>]),
        journal: &mut Vec<U>,
        undo: fn(Added<K>) -> U,
    ) -> Result<(), DatapathError> {
        let (have_allow, have_deny) = self
            .installed
            .get(&ip)
            .map(|(a, d)| {
                (
                    a.iter().map(id).collect::<HashSet<_>>(),
                    d.iter().map(id).collect::<HashSet<_>>(),
                )
            })
            .unwrap_or_default();
        for k in want_allow.iter().filter(|k| !have_allow.contains(&id(k))) {
            self.allow
                .insert(k, 1, 0)
                .map_err(|e| map_err(self.writing[0], &e))?;
            journal.push(undo(Added::Allow(*k)));
        }
        for k in want_deny.iter().filter(|k| !have_deny.contains(&id(k))) {
            self.deny
                .insert(k, deny_value(k), 0)
                .map_err(|e| map_err(self.writing[1], &e))?;
            journal.push(undo(Added::Deny(*k)));
        }
        Ok(())
    }

    /// Takes back a key [`Self::write`] added.
    pub(super) fn roll_back(&mut self, added: Added<K>) -> Result<(), aya::maps::MapError> {
        match added {
            Added::Allow(k) => self.allow.remove(&k),
            Added::Deny(k) => self.deny.remove(&k),
        }
    }

    /// Committed: removes the keys the sandbox had and no longer wants,
    /// and records what it has now.
    pub(super) fn commit(&mut self, ip: u32, want: Wanted<K>) {
        let (old_allow, old_deny) = self.installed.remove(&ip).unwrap_or_default();
        let keep: HashSet<Id<K>> = want.0.iter().map(id).collect();
        for k in old_allow.iter().filter(|k| !keep.contains(&id(k))) {
            let _ = self.allow.remove(k);
        }
        let keep: HashSet<Id<K>> = want.1.iter().map(id).collect();
        for k in old_deny.iter().filter(|k| !keep.contains(&id(k))) {
            let _ = self.deny.remove(k);
        }
        // Only sandboxes with rules have an entry (most have none: an empty
        // entry each was ~1.5 MB at 10,000 sandboxes).
        if !(want.0.is_empty() && want.1.is_empty()) {
            self.installed.insert(ip, want);
        }
    }

    /// The sandbox is released: its keys go.
    pub(super) fn remove(&mut self, ip: u32) {
        self.commit(ip, Wanted::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs<K: PolicyData>(keys: &[Key<K>]) -> Vec<u32> {
        keys.iter().map(|k| k.prefix_len() - 32).collect()
    }

    #[test]
    fn each_family_takes_its_cidrs_and_both_take_the_deny_catch_all() {
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mixed = list(&["10.0.0.0/8", "2001:db8::/32", "*.example.com"]);
        assert_eq!(cidrs(&keys4(7, &mixed, true)), vec![8]);
        let k6 = keys6(7, &mixed, true);
        assert_eq!(cidrs(&k6), vec![32]);
        assert_eq!(k6[0].data().sandbox_ip, 7);
        assert_eq!(k6[0].data().dst[..4], [0x20, 0x01, 0x0d, 0xb8]);
        // The catch-all deny of either family closes both, once.
        for all in ["0.0.0.0/0", "::/0"] {
            let l = list(&[all, "2001:db8::1/128"]);
            assert_eq!(cidrs(&keys4(7, &l, true)), vec![0], "{all}");
            assert!(cidrs(&keys6(7, &l, true)).contains(&0), "{all}");
        }
        let both = list(&["0.0.0.0/0", "::/0"]);
        assert_eq!(cidrs(&keys4(7, &both, true)), vec![0]);
        assert_eq!(cidrs(&keys6(7, &both, true)), vec![0]);
        // An allow CIDR stays in its family.
        assert!(keys6(7, &list(&["0.0.0.0/0"]), false).is_empty());
        assert!(keys4(7, &list(&["::/0"]), false).is_empty());
    }
}
