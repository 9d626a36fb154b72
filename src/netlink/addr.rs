//! Addresses: adding IPv4 and IPv6 (no DAD) addresses and reading a
//! device's or the node's addresses.

use std::net::{IpAddr, Ipv4Addr};

use futures::stream::TryStreamExt;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::{
    AddressFamily,
    address::AddressAttribute,
    route::{RouteHeader, RouteType},
};
use tracing::debug;

use super::route::{route_oif, route_table};
use super::{Netlink, NetlinkError, is_errno};

impl Netlink {
    /// Adds `addr/prefix_len` to `index`; present already counts as done.
    pub async fn add_ipv4_addr(
        &self,
        index: u32,
        addr: Ipv4Addr,
        prefix_len: u8,
    ) -> Result<(), NetlinkError> {
        debug!(index, %addr, prefix_len, "add address");
        let res = self
            .handle
            .address()
            .add(index, IpAddr::V4(addr), prefix_len)
            .execute()
            .await;
        match res {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
            Err(source) => Err(NetlinkError::AddrAdd {
                index,
                addr: IpAddr::V4(addr),
                prefix_len,
                source,
            }),
        }
    }

    /// Adds an IPv6 address without duplicate address detection (usable at
    /// once: on a link whose only other node never claims it). EEXIST is
    /// success.
    pub async fn add_ipv6_addr_nodad(
        &self,
        index: u32,
        addr: std::net::Ipv6Addr,
        prefix_len: u8,
    ) -> Result<(), NetlinkError> {
        use rtnetlink::packet_route::address::AddressFlags;
        debug!(index, %addr, prefix_len, "add address (nodad)");
        let mut req = self
            .handle
            .address()
            .add(index, IpAddr::V6(addr), prefix_len);
        req.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
        match req.execute().await {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
            Err(source) => Err(NetlinkError::AddrAdd {
                index,
                addr: IpAddr::V6(addr),
                prefix_len,
                source,
            }),
        }
    }

    /// Every IPv6 address of `ifindex`.
    pub async fn ipv6_addrs(&self, ifindex: u32) -> Result<Vec<std::net::Ipv6Addr>, NetlinkError> {
        Ok(self
            .addr_dump(AddressFamily::Inet6, Some(ifindex))
            .await?
            .iter()
            .filter(|m| m.header.index == ifindex)
            .filter_map(|m| {
                m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(IpAddr::V6(v6)) => Some(*v6),
                    _ => None,
                })
            })
            .collect())
    }

    /// The address NAT66 uses on `ifindex`: a global-scope IPv6 address
    /// that is usable (not tentative, failed or deprecated) and not a
    /// temporary (privacy) one, global unicast (2000::/3) first; `None`
    /// also when the namespace has no IPv6 default route out of `ifindex`
    /// (nothing would carry the sandboxes' IPv6 to the world).
    pub async fn ipv6_egress_addr(
        &self,
        ifindex: u32,
    ) -> Result<Option<std::net::Ipv6Addr>, NetlinkError> {
        use rtnetlink::packet_route::address::{AddressFlags, AddressScope};
        let req = RouteMessageBuilder::<std::net::Ipv6Addr>::new().build();
        let routes = self.route_dump(req, "ipv6 routes").await?;
        let default_out = routes.iter().any(|r| {
            r.header.destination_prefix_length == 0
                && r.header.kind == RouteType::Unicast
                && route_table(r) == u32::from(RouteHeader::RT_TABLE_MAIN)
                && route_oif(r) == Some(ifindex)
        });
        if !default_out {
            debug!(ifindex, "no ipv6 default route out of the uplink");
            return Ok(None);
        }
        let msgs = self.addr_dump(AddressFamily::Inet6, Some(ifindex)).await?;
        let unusable = AddressFlags::Tentative
            | AddressFlags::Dadfailed
            | AddressFlags::Deprecated
            | AddressFlags::Secondary;
        let mut found: Vec<std::net::Ipv6Addr> = msgs
            .iter()
            .filter(|m| {
                m.header.family == AddressFamily::Inet6
                    && m.header.index == ifindex
                    && m.header.scope == AddressScope::Universe
            })
            .filter(|m| {
                let flags = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Flags(f) => Some(*f),
                    _ => None,
                });
                !flags.is_some_and(|f| f.intersects(unusable))
            })
            .filter_map(|m| {
                m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(IpAddr::V6(v6)) => Some(*v6),
                    _ => None,
                })
            })
            .collect();
        found.sort_by_key(|a| (a.segments()[0] >> 13) != 1);
        Ok(found.first().copied())
    }

    /// Every IPv4 address of the namespace (any link).
    pub async fn local_ipv4_addrs(&self) -> Result<Vec<Ipv4Addr>, NetlinkError> {
        Ok(self
            .ipv4_addr_dump(None)
            .await?
            .into_iter()
            .map(|(a, _, _)| a)
            .collect())
    }

    /// IPv4 addresses (address, prefix length) on `ifindex`, in kernel order.
    pub async fn ipv4_addrs(&self, ifindex: u32) -> Result<Vec<(Ipv4Addr, u8)>, NetlinkError> {
        Ok(self
            .ipv4_addr_dump(Some(ifindex))
            .await?
            .into_iter()
            .filter(|(_, _, index)| *index == ifindex)
            .map(|(a, len, _)| (a, len))
            .collect())
    }

    /// The address messages of `family` on `ifindex`, or on every link
    /// (one dump at a time).
    pub(super) async fn addr_dump(
        &self,
        family: AddressFamily,
        ifindex: Option<u32>,
    ) -> Result<Vec<rtnetlink::packet_route::address::AddressMessage>, NetlinkError> {
        debug!(?ifindex, ?family, "dump addresses");
        let _one = self.dumps.lock().await;
        let mut req = self.handle.address().get();
        if let Some(index) = ifindex {
            req = req.set_link_index_filter(index);
        }
        req.message_mut().header.family = family;
        req.execute()
            .try_collect()
            .await
            .map_err(|source| NetlinkError::Dump {
                what: "addresses",
                source,
            })
    }

    /// (address, prefix length, ifindex) of the IPv4 addresses on `ifindex`,
    /// or on every link.
    pub(super) async fn ipv4_addr_dump(
        &self,
        ifindex: Option<u32>,
    ) -> Result<Vec<(Ipv4Addr, u8, u32)>, NetlinkError> {
        let msgs = self.addr_dump(AddressFamily::Inet, ifindex).await?;
        let mut out = Vec::new();
        for m in msgs
            .iter()
            .filter(|m| m.header.family == AddressFamily::Inet)
        {
            // IFA_LOCAL is the interface's own address; IFA_ADDRESS differs from it
            // only on point-to-point links (peer address).
            let local = m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(IpAddr::V4(v4)) => Some(*v4),
                _ => None,
            });
            let address = m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(IpAddr::V4(v4)) => Some(*v4),
                _ => None,
            });
            if let Some(a) = local.or(address) {
                out.push((a, m.header.prefix_len, m.header.index));
            }
        }
        Ok(out)
    }
}
