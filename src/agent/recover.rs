//! Start-up recovery, step 2 of collect → classify → apply: a pure function
//! from the facts (records on disk, our links in the kernel, neighbour
//! entries on the gateway device) to a plan. Applying it is in `mod.rs`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;

use super::spec::{NetworkRecord, TapNameKind, classify_tap_name};
use crate::alloc::{IpAllocator, PortAllocator};
use crate::netlink::LinkInfo;

/// What to do with everything found at start.
#[derive(Debug, Default)]
pub struct Plan {
    /// Valid records with the link that carries their TAP, if it still exists.
    pub networks: Vec<(NetworkRecord, Option<LinkInfo>)>,
    /// Records that cannot be used: (key, bytes, reason).
    pub quarantine: Vec<(String, Vec<u8>, String)>,
    /// Idle pool TAPs to adopt.
    pub pool: Vec<LinkInfo>,
    /// Our TAPs nobody owns (crash between TAP set-up and the record
    /// write, or between record removal and TAP reset) and TAPs that were
    /// being retired: delete them.
    pub retire: Vec<LinkInfo>,
    /// Neighbour entries for pool addresses no record owns.
    pub stale_neighbours: Vec<IpAddr>,
    /// Highest pool-name counter seen, so new names do not collide.
    pub max_pool_name: Option<u32>,
}

/// Classifies the facts. `ips` and `ports` are fresh allocators; every
/// address and host port of the accepted records is reserved in them, and
/// a record whose address or port is already taken by an earlier record
/// (oldest first) is quarantined rather than trusted.
pub fn classify(
    tap_prefix: &str,
    retire_group: u32,
    records: BTreeMap<String, Vec<u8>>,
    links: &[LinkInfo],
    neighbours: &[IpAddr],
    ips: &mut IpAllocator,
    ports: &mut PortAllocator,
) -> Plan {
    let mut plan = Plan::default();
    let mut parsed: Vec<(NetworkRecord, Vec<u8>)> = vec![];
    for (key, bytes) in records {
        match NetworkRecord::from_bytes(&key, &bytes) {
            Ok(rec) => parsed.push((rec, bytes)),
            Err(reason) => plan.quarantine.push((key, bytes, reason)),
        }
    }
    parsed.sort_by(|a, b| {
        (a.0.created_unix, &a.0.sandbox_id).cmp(&(b.0.created_unix, &b.0.sandbox_id))
    });

    let mut by_tap: HashMap<String, usize> = HashMap::new();
    let mut accepted: Vec<NetworkRecord> = vec![];
    for (rec, bytes) in parsed {
        match admit(&rec, ips, ports, &by_tap) {
            Ok(()) => {
                by_tap.insert(rec.tap_name.clone(), accepted.len());
                accepted.push(rec);
            }
            Err(reason) => plan
                .quarantine
                .push((rec.sandbox_id.clone(), bytes, reason)),
        }
    }

    let mut link_of: Vec<Option<LinkInfo>> = vec![None; accepted.len()];
    for link in links
        .iter()
        .filter(|l| matches!(l.kind.as_deref(), Some("tun" | "veth")))
    {
        let named = classify_tap_name(tap_prefix, &link.name);
        // Sandboxes' TAPs keep their pool names: new names must not
        // collide with those either.
        if let TapNameKind::Pool(n) = named {
            plan.max_pool_name = plan.max_pool_name.max(Some(n));
        }
        if let Some(&i) = by_tap.get(&link.name)
            && link.kind.as_deref() == Some(accepted[i].attach.link_kind())
        {
            link_of[i] = Some(link.clone());
            continue;
        }
        match named {
            _ if link.group == retire_group => plan.retire.push(link.clone()),
            TapNameKind::Pool(_) if link.kind.as_deref() == Some("veth") => {
                plan.retire.push(link.clone())
            }
            // Only a TAP the pool marked idle when it last reset it is
            // clean: never handed to a VMM (handed-out TAPs are deleted at
            // release, never pooled). Anything else — in use by a network
            // whose record is gone, or pooled by a version before that
            // rule — is retired.
            TapNameKind::Pool(_) if link.alias.as_deref() == Some(super::pool::IDLE_ALIAS) => {
                plan.pool.push(link.clone())
            }
            TapNameKind::Pool(_) => plan.retire.push(link.clone()),
            // A by-name TAP without a record: its network was released
            // (or never answered) before a crash.
            TapNameKind::Sandbox(_) | TapNameKind::ByName(_) => plan.retire.push(link.clone()),
            TapNameKind::Foreign => {}
        }
    }

    let owned: HashSet<IpAddr> = accepted.iter().map(|r| r.sandbox_ip).collect();
    let pool = ips.cidr();
    plan.stale_neighbours = neighbours
        .iter()
        .filter(|ip| match ip {
            IpAddr::V4(v4) => pool.contains(*v4) && *v4 != pool.gateway() && !owned.contains(ip),
            IpAddr::V6(_) => false,
        })
        .copied()
        .collect();
    plan.networks = accepted.into_iter().zip(link_of).collect();
    plan
}

/// Reserves a record's address and ports, or says why it cannot be trusted.
fn admit(
    rec: &NetworkRecord,
    ips: &mut IpAllocator,
    ports: &mut PortAllocator,
    by_tap: &HashMap<String, usize>,
) -> Result<(), String> {
    let IpAddr::V4(ip) = rec.sandbox_ip else {
        return Err(format!("sandbox_ip {} is not IPv4", rec.sandbox_ip));
    };
    ips.reserve(ip)
        .map_err(|e| format!("sandbox_ip {ip} (pool {}): {e}", ips.cidr()))?;
    if by_tap.contains_key(&rec.tap_name) {
        ips.release(ip);
        return Err(format!(
            "TAP {} already belongs to another record",
            rec.tap_name
        ));
    }
    for (i, m) in rec.port_mappings.iter().enumerate() {
        if let Err(e) = ports.reserve(m.protocol, m.host_port) {
            for m in &rec.port_mappings[..i] {
                ports.release(m.protocol, m.host_port);
            }
            ips.release(ip);
            return Err(format!("port_mappings[{i}]: {e}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::spec::{PortMapping, RECORD_VERSION, pool_tap_name, tap_name_for};
    use crate::alloc::{PortSet, Protocol};

    fn rec(id: &str, ip: &str, ports: &[u16], created: u64) -> NetworkRecord {
        let ip: IpAddr = ip.parse().unwrap();
        NetworkRecord {
            version: RECORD_VERSION,
            sandbox_id: id.into(),
            network_handle: "h".into(),
            sandbox_ip: ip,
            tap_name: tap_name_for("ctap", ip),
            mtu: 1300,
            port_mappings: ports
                .iter()
                .map(|p| PortMapping {
                    protocol: Protocol::Tcp,
                    container_port: 80,
                    host_port: *p,
                    host_ip: "0.0.0.0".into(),
                })
                .collect(),
            allow_internet_access: true,
            allow_out: vec![],
            deny_out: vec![],
            metadata: Default::default(),
            idempotency_key: None,
            created_unix: created,
            attach: Default::default(),
            egress_mode: Default::default(),
            bandwidth: Default::default(),
            cloned_from: None,
            paused: false,
            mapping_wins: false,
            tap_owner: None,
            egress_rules: vec![],
        }
    }

    fn link(index: u32, name: &str, kind: &str, group: u32) -> LinkInfo {
        LinkInfo {
            index,
            name: name.into(),
            kind: Some(kind.into()),
            group,
            up: true,
            mtu: 1300,
            mac: None,
            alias: None,
            counters: Default::default(),
        }
    }

    fn idle(mut l: LinkInfo) -> LinkInfo {
        l.alias = Some(crate::agent::pool::IDLE_ALIAS.into());
        l.up = false;
        l
    }

    fn allocs() -> (IpAllocator, PortAllocator) {
        (
            IpAllocator::new("192.168.0.0/24".parse().unwrap()).unwrap(),
            PortAllocator::new(20000, 20010, PortSet::default()),
        )
    }

    fn records(recs: &[NetworkRecord]) -> BTreeMap<String, Vec<u8>> {
        recs.iter()
            .map(|r| (r.sandbox_id.clone(), r.to_bytes()))
            .collect()
    }

    #[test]
    fn healthy_repairable_orphan_pool_and_retiring() {
        let a = rec("a", "192.168.0.2", &[20000], 1);
        let b = rec("b", "192.168.0.3", &[], 2);
        let links = vec![
            link(10, &a.tap_name, "tun", 0),
            // b's TAP is gone: repairable.
            link(11, "ctapc0a80009", "tun", 0), // orphan sandbox TAP
            idle(link(12, &pool_tap_name("ctap", 7), "tun", 0)),
            idle(link(13, &pool_tap_name("ctap", 3), "tun", 0xc0be)), // being retired
            // A pool TAP without the pool's idle mark: in use when the
            // agent died (its record gone), or pooled by an older version
            // that pooled TAPs a VMM may still hold.
            link(17, &pool_tap_name("ctap", 4), "tun", 0),
            link(14, "eth0", "veth", 0),
            link(15, "ctapc0a8000a", "bridge", 0), // not a TAP: not ours
            link(16, "othertap", "tun", 0),        // foreign TAP
        ];
        let neigh: Vec<IpAddr> = ["192.168.0.2", "192.168.0.9", "192.168.0.1", "10.0.0.1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let (mut ips, mut ports) = allocs();
        let plan = classify(
            "ctap",
            0xc0be,
            records(&[a.clone(), b.clone()]),
            &links,
            &neigh,
            &mut ips,
            &mut ports,
        );
        assert_eq!(plan.networks.len(), 2);
        assert_eq!(plan.networks[0].0, a);
        assert_eq!(plan.networks[0].1.as_ref().map(|l| l.index), Some(10));
        assert_eq!(plan.networks[1].0, b);
        assert!(plan.networks[1].1.is_none());
        assert_eq!(
            plan.pool.iter().map(|l| l.index).collect::<Vec<_>>(),
            vec![12]
        );
        let mut retired: Vec<u32> = plan.retire.iter().map(|l| l.index).collect();
        retired.sort();
        assert_eq!(retired, vec![11, 13, 17]);
        assert_eq!(
            plan.stale_neighbours,
            vec!["192.168.0.9".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(plan.max_pool_name, Some(7));
        assert!(plan.quarantine.is_empty());
        assert!(ips.is_allocated("192.168.0.2".parse().unwrap()));
        assert!(ports.is_used(Protocol::Tcp, 20000));
    }

    #[test]
    fn corrupt_and_conflicting_records_are_quarantined() {
        let old = rec("old", "192.168.0.2", &[20001], 1);
        let same_ip = rec("same-ip", "192.168.0.2", &[], 2);
        let same_port = rec("same-port", "192.168.0.4", &[20001], 3);
        let outside = rec("outside", "10.9.9.9", &[], 4);
        let mut recs = records(&[old.clone(), same_ip, same_port, outside]);
        recs.insert("garbage".into(), b"{not json".to_vec());
        let mut wrong_key = rec("x", "192.168.0.5", &[], 5).to_bytes();
        recs.insert("y".into(), std::mem::take(&mut wrong_key));
        let (mut ips, mut ports) = allocs();
        let plan = classify("ctap", 0xc0be, recs, &[], &[], &mut ips, &mut ports);
        assert_eq!(plan.networks.len(), 1);
        assert_eq!(plan.networks[0].0, old);
        let mut q: Vec<(&str, &str)> = plan
            .quarantine
            .iter()
            .map(|(k, _, why)| (k.as_str(), why.as_str()))
            .collect();
        q.sort();
        assert_eq!(q.len(), 5, "{q:?}");
        assert!(q[0].0 == "garbage" && q[0].1.contains("not a valid record"));
        assert!(q[1].0 == "outside" && q[1].1.contains("outside the pool"));
        assert!(q[2].0 == "same-ip" && q[2].1.contains("already allocated"));
        assert!(q[3].0 == "same-port" && q[3].1.contains("port_mappings[0]"));
        assert!(q[4].0 == "y" && q[4].1.contains("stored under"));
        // The rejected record's address was not left reserved.
        assert!(!ips.is_allocated("192.168.0.4".parse().unwrap()));
        assert_eq!(ips.free(), ips.capacity() - 1);
    }
}
