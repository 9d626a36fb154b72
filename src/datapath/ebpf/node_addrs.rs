//! `node_addrs` and `node_addrs6`: the node's own addresses, every
//! device's, so that a sandbox's packet to one never leaves by the uplink
//! (`guest_to_world`, `guest6_out`). Written before the programs run at
//! every start, then again on each address notification (the agent's
//! `run_node_addrs`).

use std::collections::BTreeSet;
use std::net::IpAddr;

use aya::maps::{HashMap, MapData};

use super::entries::map_err;
use super::ip_be;
use crate::datapath::DatapathError;
use crate::datapath::maps::NODE_ADDRS_ENTRIES;

/// Makes the maps hold exactly `addrs` (the first `NODE_ADDRS_ENTRIES` of
/// each family); returns how many entries were added or removed.
pub(super) fn sync(
    v4: &mut HashMap<MapData, u32, u8>,
    v6: &mut HashMap<MapData, [u8; 16], u8>,
    addrs: &[IpAddr],
) -> Result<usize, DatapathError> {
    let cap = NODE_ADDRS_ENTRIES as usize;
    let want4: BTreeSet<u32> = addrs
        .iter()
        .filter_map(|a| match a {
            IpAddr::V4(a) => Some(ip_be(*a)),
            IpAddr::V6(_) => None,
        })
        .take(cap)
        .collect();
    let want6: BTreeSet<[u8; 16]> = addrs
        .iter()
        .filter_map(|a| match a {
            IpAddr::V6(a) => Some(a.octets()),
            IpAddr::V4(_) => None,
        })
        .take(cap)
        .collect();
    let mut changed = 0;
    let have4: BTreeSet<u32> = v4.keys().flatten().collect();
    for k in have4.difference(&want4) {
        if v4.remove(k).is_ok() {
            changed += 1;
        }
    }
    for k in want4.difference(&have4) {
        v4.insert(k, 1, 0)
            .map_err(|e| map_err("writing node_addrs", &e))?;
        changed += 1;
    }
    let have6: BTreeSet<[u8; 16]> = v6.keys().flatten().collect();
    for k in have6.difference(&want6) {
        if v6.remove(k).is_ok() {
            changed += 1;
        }
    }
    for k in want6.difference(&have6) {
        v6.insert(k, 1, 0)
            .map_err(|e| map_err("writing node_addrs6", &e))?;
        changed += 1;
    }
    Ok(changed)
}
