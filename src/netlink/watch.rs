//! Notification threads: the watch_* subscriptions to the kernel's
//! multicast groups (tc, links, addresses, IPv6 routes).

use tracing::debug;

use super::NetlinkError;
use super::link::LinkInfo;

/// A clsact hook of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TcHook {
    Ingress,
    Egress,
}

impl std::fmt::Display for TcHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TcHook::Ingress => "ingress",
            TcHook::Egress => "egress",
        })
    }
}

/// A tc change the kernel announced on RTNLGRP_TC that can take a datapath
/// filter away: a qdisc or a filter deleted on `ifindex`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcRemoval {
    pub ifindex: u32,
    /// "qdisc clsact", "filter bpf"...
    pub what: String,
}

/// Subscribes to the kernel's tc notifications (RTNLGRP_TC) and sends every
/// qdisc or filter removal to `tx`. The subscription is active when this
/// returns (nothing deleted after it is missed); the reader task ends when
/// `tx` is closed. Must be called inside a tokio runtime.
pub fn watch_tc_removals(
    tx: tokio::sync::mpsc::UnboundedSender<TcRemoval>,
) -> Result<(), NetlinkError> {
    use futures::StreamExt;
    use rtnetlink::packet_core::NetlinkPayload;
    use rtnetlink::packet_route::{RouteNetlinkMessage, tc::TcAttribute};
    let rt = tokio::runtime::Handle::try_current().map_err(|_| NetlinkError::NoRuntime)?;
    let (conn, _handle, mut messages) =
        rtnetlink::new_multicast_connection(&[rtnetlink::MulticastGroup::Tc])
            .map_err(NetlinkError::Connect)?;
    rt.spawn(conn);
    rt.spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let (kind, m) = match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelQueueDiscipline(m)) => {
                    ("qdisc", m)
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelTrafficFilter(m)) => {
                    ("filter", m)
                }
                _ => continue,
            };
            let name = m
                .attributes
                .iter()
                .find_map(|a| match a {
                    TcAttribute::Kind(k) => Some(k.as_str()),
                    _ => None,
                })
                .unwrap_or("?");
            let removal = TcRemoval {
                ifindex: m.header.index as u32,
                what: format!("{kind} {name}"),
            };
            debug!(?removal, "tc removal announced");
            if tx.send(removal).is_err() {
                break;
            }
        }
    });
    Ok(())
}

/// A link change the kernel announced on RTNLGRP_LINK: the device's state
/// now, or `None` when it left this namespace (deleted, or moved to
/// another one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEvent {
    pub ifindex: u32,
    pub now: Option<LinkInfo>,
}

/// Subscribes to the kernel's link notifications (RTNLGRP_LINK) and sends
/// each to `tx`; active when this returns. The kernel announces every
/// change of flags, name or namespace, so a sandbox device someone else
/// deletes, renames, moves or sets down is known within milliseconds.
pub fn watch_links(tx: tokio::sync::mpsc::UnboundedSender<LinkEvent>) -> Result<(), NetlinkError> {
    use futures::StreamExt;
    use rtnetlink::packet_core::NetlinkPayload;
    use rtnetlink::packet_route::RouteNetlinkMessage;
    let rt = tokio::runtime::Handle::try_current().map_err(|_| NetlinkError::NoRuntime)?;
    let (conn, _handle, mut messages) =
        rtnetlink::new_multicast_connection(&[rtnetlink::MulticastGroup::Link])
            .map_err(NetlinkError::Connect)?;
    rt.spawn(conn);
    rt.spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let event = match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => LinkEvent {
                    ifindex: m.header.index,
                    now: Some(LinkInfo::from_msg(&m)),
                },
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => LinkEvent {
                    ifindex: m.header.index,
                    now: None,
                },
                _ => continue,
            };
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    Ok(())
}

/// Subscribes to the kernel's IPv6 address and route notifications
/// (RTNLGRP_IPV6_IFADDR, RTNLGRP_IPV6_ROUTE) and pokes `tx` on each (the
/// receiver reads the state again: a notification says that something
/// changed, a dump says what is); active when this returns.
pub fn watch_ipv6_addrs_and_routes(
    tx: tokio::sync::mpsc::UnboundedSender<()>,
) -> Result<(), NetlinkError> {
    poke_on(
        &[
            rtnetlink::MulticastGroup::Ipv6Ifaddr,
            rtnetlink::MulticastGroup::Ipv6Route,
        ],
        tx,
    )
}

/// Pokes `tx` on every notification of `groups`; active when this returns.
pub(super) fn poke_on(
    groups: &[rtnetlink::MulticastGroup],
    tx: tokio::sync::mpsc::UnboundedSender<()>,
) -> Result<(), NetlinkError> {
    use futures::StreamExt;
    let rt = tokio::runtime::Handle::try_current().map_err(|_| NetlinkError::NoRuntime)?;
    let (conn, _handle, mut messages) =
        rtnetlink::new_multicast_connection(groups).map_err(NetlinkError::Connect)?;
    rt.spawn(conn);
    rt.spawn(async move {
        while messages.next().await.is_some() {
            if tx.send(()).is_err() {
                break;
            }
        }
    });
    Ok(())
}

/// Subscribes to the kernel's address notifications of both families
/// (RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR) and pokes `tx` on each;
/// active when this returns.
pub fn watch_addrs(tx: tokio::sync::mpsc::UnboundedSender<()>) -> Result<(), NetlinkError> {
    poke_on(
        &[
            rtnetlink::MulticastGroup::Ipv4Ifaddr,
            rtnetlink::MulticastGroup::Ipv6Ifaddr,
        ],
        tx,
    )
}
