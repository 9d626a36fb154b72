//! Routes: default and prefix routes (with MTU), IPv6 routes and the
//! default uplink.

use std::net::Ipv4Addr;

use futures::stream::TryStreamExt;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType,
};
use tracing::debug;

use super::link::LinkInfo;
use super::{Netlink, NetlinkError};

impl Netlink {
    /// Whether the namespace has an IPv6 default route out of `oif`.
    pub async fn ipv6_default_route(&self, oif: u32) -> Result<bool, NetlinkError> {
        self.ipv6_route((std::net::Ipv6Addr::UNSPECIFIED, 0), oif)
            .await
    }

    /// Whether an IPv6 route to `dest/prefix_len` out of `oif` exists (a
    /// /0 carries no destination).
    pub async fn ipv6_route(
        &self,
        (dest, prefix_len): (std::net::Ipv6Addr, u8),
        oif: u32,
    ) -> Result<bool, NetlinkError> {
        use rtnetlink::packet_route::route::RouteAddress;
        let req = RouteMessageBuilder::<std::net::Ipv6Addr>::new().build();
        Ok(self
            .route_dump(req, "ipv6 routes")
            .await?
            .iter()
            .any(|r| {
                r.header.destination_prefix_length == prefix_len
                    && route_oif(r) == Some(oif)
                    && (prefix_len == 0
                        || r.attributes.iter().any(|a| {
                            matches!(a, RouteAttribute::Destination(RouteAddress::Inet6(d)) if *d == dest)
                        }))
            }))
    }

    /// Adds (or replaces) the IPv4 default route via `gateway` on `oif`.
    pub async fn replace_default_route(
        &self,
        gateway: Ipv4Addr,
        oif: u32,
    ) -> Result<(), NetlinkError> {
        debug!(%gateway, oif, "replace default route");
        let msg = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .gateway(gateway)
            .output_interface(oif)
            .build();
        self.handle
            .route()
            .add(msg)
            .replace()
            .execute()
            .await
            .map_err(|source| NetlinkError::RouteAdd {
                gateway,
                oif,
                source,
            })
    }

    /// Sets the MTU of the route the kernel made for `src`'s address on
    /// `oif` (`dest/prefix_len`, proto kernel, scope link): what the host's
    /// own packets to addresses behind it may carry. Its TCP advertises a
    /// matching MSS and its larger datagrams are fragmented before they
    /// leave, instead of being lost on a smaller link further on.
    pub async fn set_prefix_route_mtu(
        &self,
        dest: Ipv4Addr,
        prefix_len: u8,
        oif: u32,
        src: Ipv4Addr,
        mtu: u32,
    ) -> Result<(), NetlinkError> {
        use rtnetlink::packet_route::route::{RouteProtocol, RouteScope};
        debug!(%dest, prefix_len, oif, mtu, "set the prefix route's MTU");
        let msg = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(mask(dest, prefix_len), prefix_len)
            .output_interface(oif)
            .pref_source(src)
            .protocol(RouteProtocol::Kernel)
            .scope(RouteScope::Link)
            .table_id(254)
            .build();
        self.replace_route_with_mtu(msg, mtu)
            .await
            .map_err(|source| NetlinkError::RouteAdd {
                gateway: src,
                oif,
                source,
            })
    }

    /// Adds or replaces the route `msg` with an MTU metric.
    pub(super) async fn replace_route_with_mtu(
        &self,
        mut msg: RouteMessage,
        mtu: u32,
    ) -> Result<(), rtnetlink::Error> {
        use rtnetlink::packet_route::route::RouteMetric;
        msg.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
        self.handle.route().add(msg).replace().execute().await
    }

    /// Replaces the IPv6 route `dest/prefix_len` via the link-local `via`
    /// on `oif`, with preferred source `src` and an MTU.
    pub async fn replace_ipv6_route_via(
        &self,
        (dest, prefix_len): (std::net::Ipv6Addr, u8),
        via: std::net::Ipv6Addr,
        oif: u32,
        src: std::net::Ipv6Addr,
        mtu: u32,
    ) -> Result<(), NetlinkError> {
        debug!(%dest, prefix_len, %via, oif, mtu, "replace IPv6 route");
        let msg = RouteMessageBuilder::<std::net::Ipv6Addr>::new()
            .destination_prefix(dest, prefix_len)
            .gateway(via)
            .output_interface(oif)
            .pref_source(src)
            .build();
        self.replace_route_with_mtu(msg, mtu)
            .await
            .map_err(|source| NetlinkError::Route6Add {
                dest,
                prefix_len,
                oif,
                source,
            })
    }

    /// The MTU metric of the IPv4 route `dest/prefix_len` on `oif`, if it
    /// has one.
    pub async fn route_mtu(
        &self,
        dest: Ipv4Addr,
        prefix_len: u8,
        oif: u32,
    ) -> Result<Option<u32>, NetlinkError> {
        use rtnetlink::packet_route::route::RouteMetric;
        let want = mask(dest, prefix_len);
        Ok(self
            .ipv4_routes()
            .await?
            .iter()
            .filter(|r| {
                r.header.destination_prefix_length == prefix_len
                    && route_oif(r) == Some(oif)
                    && mask(route_dst(r), prefix_len) == want
            })
            .flat_map(|r| r.attributes.iter())
            .find_map(|a| match a {
                RouteAttribute::Metrics(m) => m.iter().find_map(|m| match m {
                    RouteMetric::Mtu(v) => Some(*v),
                    _ => None,
                }),
                _ => None,
            }))
    }

    /// Whether an IPv4 default route via `gateway` on `oif` exists.
    pub async fn default_route_via(
        &self,
        gateway: Ipv4Addr,
        oif: u32,
    ) -> Result<bool, NetlinkError> {
        Ok(self.ipv4_routes().await?.iter().any(|r| {
            r.header.destination_prefix_length == 0
                && route_oif(r) == Some(oif)
                && r.attributes.iter().any(|a| {
                    matches!(a, RouteAttribute::Gateway(RouteAddress::Inet(g)) if *g == gateway)
                })
        }))
    }

    pub(super) async fn ipv4_routes(&self) -> Result<Vec<RouteMessage>, NetlinkError> {
        let req = RouteMessageBuilder::<Ipv4Addr>::new().build();
        self.route_dump(req, "ipv4 routes").await
    }

    /// Every route of the family `req` asks for.
    pub(super) async fn route_dump(
        &self,
        req: RouteMessage,
        what: &'static str,
    ) -> Result<Vec<RouteMessage>, NetlinkError> {
        debug!(what, "dump routes");
        let _one = self.dumps.lock().await;
        self.handle
            .route()
            .get(req)
            .execute()
            .try_collect()
            .await
            .map_err(|source| NetlinkError::Dump { what, source })
    }

    /// The IPv4 default route's output interface (lowest metric, main table) and that
    /// interface's first IPv4 address; None if there is no default route.
    pub async fn default_uplink(
        &self,
    ) -> Result<Option<(LinkInfo, Option<Ipv4Addr>)>, NetlinkError> {
        let best = self
            .ipv4_routes()
            .await?
            .iter()
            .filter(|r| {
                r.header.destination_prefix_length == 0
                    && r.header.kind == RouteType::Unicast
                    && route_table(r) == u32::from(RouteHeader::RT_TABLE_MAIN)
            })
            .filter_map(|r| route_oif(r).map(|oif| (route_metric(r), oif)))
            .min();
        let Some((metric, oif)) = best else {
            debug!("no ipv4 default route");
            return Ok(None);
        };
        debug!(oif, metric, "default route");
        let Some(link) = self.link_by_index(oif).await? else {
            return Ok(None);
        };
        let addr = self.ipv4_addrs(oif).await?.first().map(|(a, _)| *a);
        Ok(Some((link, addr)))
    }

    /// Whether an IPv4 route `dest/prefix_len` with output interface `oif` exists in
    /// any table (`dest` is compared after masking to `prefix_len`).
    pub async fn route_exists(
        &self,
        dest: Ipv4Addr,
        prefix_len: u8,
        oif: u32,
    ) -> Result<bool, NetlinkError> {
        let want = mask(dest, prefix_len);
        let found = self.ipv4_routes().await?.iter().any(|r| {
            r.header.destination_prefix_length == prefix_len
                && route_oif(r) == Some(oif)
                && mask(route_dst(r), prefix_len) == want
        });
        debug!(%dest, prefix_len, oif, found, "route exists");
        Ok(found)
    }
}

pub(super) fn mask(a: Ipv4Addr, prefix_len: u8) -> Ipv4Addr {
    let m = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(u32::from(a) & m)
}

pub(super) fn route_table(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

pub(super) fn route_metric(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// RTA_OIF, or the first multipath next hop's interface.
pub(super) fn route_oif(r: &RouteMessage) -> Option<u32> {
    r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
        _ => None,
    })
}

pub(super) fn route_dst(r: &RouteMessage) -> Ipv4Addr {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(*v4),
            _ => None,
        })
        .unwrap_or(Ipv4Addr::UNSPECIFIED)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{add_veth, in_netns};
    use super::super::*;
    use rtnetlink::RouteMessageBuilder;

    async fn add_default_route(nl: &Netlink, gw: Ipv4Addr, oif: u32, metric: u32) {
        let msg = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(gw)
            .output_interface(oif)
            .priority(metric)
            .build();
        nl.handle
            .route()
            .add(msg)
            .execute()
            .await
            .expect("add default route");
    }

    #[test]
    fn default_uplink_none_then_lowest_metric() {
        in_netns("default_uplink_none_then_lowest_metric", |nl| async move {
            assert_eq!(nl.default_uplink().await.expect("query"), None);

            let up0 = add_veth(&nl, "up0", "up1").await;
            let alt0 = add_veth(&nl, "alt0", "alt1").await;
            let addr = |i, a, p| {
                let nl = nl.clone();
                async move {
                    nl.handle
                        .address()
                        .add(i, IpAddr::V4(a), p)
                        .execute()
                        .await
                        .expect("add addr")
                }
            };
            addr(up0, Ipv4Addr::new(192, 0, 2, 10), 24).await;
            addr(alt0, Ipv4Addr::new(198, 51, 100, 10), 24).await;
            assert_eq!(nl.default_uplink().await.expect("query"), None);

            add_default_route(&nl, Ipv4Addr::new(198, 51, 100, 1), alt0, 200).await;
            add_default_route(&nl, Ipv4Addr::new(192, 0, 2, 1), up0, 100).await;
            let (link, ip) = nl
                .default_uplink()
                .await
                .expect("query")
                .expect("default route");
            assert_eq!((link.name.as_str(), link.index), ("up0", up0));
            assert_eq!(ip, Some(Ipv4Addr::new(192, 0, 2, 10)));
        });
    }
}
