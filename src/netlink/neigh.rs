//! Neighbours: permanent IPv4/IPv6 neighbour entries.

use std::net::IpAddr;

use futures::stream::TryStreamExt;
use rtnetlink::packet_route::{
    AddressFamily,
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
};
use tracing::debug;

use super::{Netlink, NetlinkError};

impl Netlink {
    /// Every neighbour entry of the node (of `family` only, when given),
    /// one dump at a time.
    pub(super) async fn neigh_dump(
        &self,
        family: Option<AddressFamily>,
    ) -> Result<Vec<NeighbourMessage>, NetlinkError> {
        let _one = self.dumps.lock().await;
        let mut req = self.handle.neighbours().get();
        if let Some(f) = family {
            req = req.set_address_family(f);
        }
        req.execute()
            .try_collect()
            .await
            .map_err(|source| NetlinkError::Dump {
                what: "neighbours",
                source,
            })
    }

    /// Whether `ip` is a permanent neighbour on `ifindex` (an IPv6-only
    /// dump: the device's IPv4 neighbours, one per sandbox, are not read).
    pub async fn ipv6_neighbour_permanent(
        &self,
        ifindex: u32,
        ip: std::net::Ipv6Addr,
    ) -> Result<bool, NetlinkError> {
        let msgs = self.neigh_dump(Some(AddressFamily::Inet6)).await?;
        Ok(msgs.iter().any(|m| {
            m.header.ifindex == ifindex
                && m.header.state == NeighbourState::Permanent
                && m.attributes.iter().any(|a| {
                    matches!(a, NeighbourAttribute::Destination(NeighbourAddress::Inet6(d)) if *d == ip)
                })
        }))
    }

    /// Permanent neighbour entry (NUD_PERMANENT), replace semantics
    /// (NLM_F_REPLACE|NLM_F_CREATE), so repeating it is fine.
    pub async fn neigh_replace_permanent(
        &self,
        ifindex: u32,
        ip: IpAddr,
        mac: [u8; 6],
    ) -> Result<(), NetlinkError> {
        debug!(ifindex, %ip, ?mac, "replace permanent neighbour");
        self.handle
            .neighbours()
            .add(ifindex, ip)
            .link_layer_address(&mac)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(|source| NetlinkError::NeighAdd {
                ifindex,
                ip,
                source,
            })
    }

    /// Deletes the neighbour entry; Ok if absent (ENOENT) or the link is gone (ENODEV).
    /// Deletes a neighbour entry; `Ok(false)` if there was none.
    pub async fn neigh_del(&self, ifindex: u32, ip: IpAddr) -> Result<bool, NetlinkError> {
        debug!(ifindex, %ip, "delete neighbour");
        let msg = super::request::neigh_msg(ifindex, ip);
        super::request::neigh_deleted(
            self.handle.neighbours().del(msg).execute().await,
            ifindex,
            ip,
        )
    }

    /// IPv4/IPv6 neighbour entries on `ifindex`: (ip, lladdr, NUD_* state).
    pub async fn neigh_list(
        &self,
        ifindex: u32,
    ) -> Result<Vec<(IpAddr, Option<[u8; 6]>, u16)>, NetlinkError> {
        debug!(ifindex, "dump neighbours");
        let msgs = self.neigh_dump(None).await?;
        let mut out = Vec::new();
        for m in msgs.iter().filter(|m| m.header.ifindex == ifindex) {
            let mut ip = None;
            let mut mac = None;
            for a in &m.attributes {
                match a {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                        ip = Some(IpAddr::V4(*v4));
                    }
                    NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                        ip = Some(IpAddr::V6(*v6));
                    }
                    NeighbourAttribute::LinkLayerAddress(l) => {
                        mac = <[u8; 6]>::try_from(l.as_slice()).ok();
                    }
                    _ => {}
                }
            }
            if let Some(ip) = ip {
                out.push((ip, mac, u16::from(m.header.state)));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{add_bridge, in_netns, up};
    use super::super::*;

    #[test]
    fn neighbour_replace_list_delete() {
        in_netns("neighbour_replace_list_delete", |nl| async move {
            let idx = add_bridge(&nl, "nb0", 0).await;
            let other = add_bridge(&nl, "nb1", 0).await;
            nl.set_link(idx, up(true)).await.expect("up");
            nl.set_link(other, up(true)).await.expect("up");
            let ip: IpAddr = Ipv4Addr::new(10, 244, 0, 7).into();
            let mac1 = [0x02, 0, 0, 0, 0, 1];
            let mac2 = [0x02, 0, 0, 0, 0, 2];
            nl.neigh_replace_permanent(idx, ip, mac1)
                .await
                .expect("add");
            nl.neigh_replace_permanent(idx, ip, mac2)
                .await
                .expect("replace");
            nl.neigh_replace_permanent(other, Ipv4Addr::new(10, 244, 0, 8).into(), mac1)
                .await
                .expect("add on other link");
            // Only the unicast IPv4 entries: an up link also gets
            // neighbours of its own whenever the kernel sends on it (IPv6
            // ND and MLD, IPv4 multicast such as IGMP's 224.0.0.22).
            let v4 = |l: Vec<(IpAddr, Option<[u8; 6]>, u16)>| -> Vec<_> {
                l.into_iter()
                    .filter(|(i, _, _)| i.is_ipv4() && !i.is_multicast())
                    .collect()
            };
            let list = v4(nl.neigh_list(idx).await.expect("list"));
            assert_eq!(list, vec![(ip, Some(mac2), libc::NUD_PERMANENT)]);
            assert!(nl.neigh_del(idx, ip).await.expect("delete"));
            assert!(
                nl.neigh_list(idx)
                    .await
                    .expect("list")
                    .iter()
                    .all(|(i, _, _)| *i != ip)
            );
            assert!(!nl.neigh_del(idx, ip).await.expect("delete absent is Ok"));
            assert_eq!(v4(nl.neigh_list(other).await.expect("list")).len(), 1);
        });
    }
}
