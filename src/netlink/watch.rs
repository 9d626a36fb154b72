//! Notification threads: the watch_* subscriptions to the kernel's
//! multicast groups (tc, links, addresses, IPv6 routes).

use tracing::debug;

use super::NetlinkError;
use super::link::LinkInfo;
use super::raw::{attrs, link_of, messages, nl_str, u32_at};

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
    // linux/rtnetlink.h, pkt_sched.h: tcmsg is 20 bytes, tcm_ifindex at 4.
    const RTNLGRP_TC: u32 = 4;
    const RTM_DELQDISC: u16 = 37;
    const RTM_DELTFILTER: u16 = 45;
    const TCA_KIND: u16 = 1;
    subscribe(RTNLGRP_TC, move |kind, msg| {
        let what = match kind {
            RTM_DELQDISC => "qdisc",
            RTM_DELTFILTER => "filter",
            _ => return true,
        };
        if msg.len() < 36 {
            return true;
        }
        let name = attrs(msg, 36)
            .find(|(k, _)| *k == TCA_KIND)
            .map_or_else(|| "?".to_owned(), |(_, p)| nl_str(p));
        let removal = TcRemoval {
            ifindex: u32_at(msg, 20),
            what: format!("{what} {name}"),
        };
        debug!(?removal, "tc removal announced");
        tx.send(removal).is_ok()
    })
}

/// `nlmsghdr` type of the lost-announcements notice [`subscribe`] makes
/// (linux/netlink.h).
const NLMSG_OVERRUN: u16 = 4;

/// A link announcement: the device `ifindex` as it is now, or `None` when
/// it was deleted (or moved away).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkEvent {
    pub ifindex: u32,
    pub now: Option<LinkInfo>,
}

impl LinkEvent {
    /// The `ifindex` (no device has 0) of the event that says
    /// announcements were lost: whoever follows links looks at all of its
    /// devices again.
    pub const LOST: u32 = 0;
}

/// Subscribes to the kernel's link notifications (RTNLGRP_LINK) and sends
/// each to `tx`; active when this returns. The kernel announces every
/// change of flags, name or namespace, so a sandbox device someone else
/// deletes, renames, moves or sets down is known within milliseconds.
pub fn watch_links(tx: tokio::sync::mpsc::UnboundedSender<LinkEvent>) -> Result<(), NetlinkError> {
    const RTNLGRP_LINK: u32 = 1;
    const RTM_DELLINK: u16 = 17;
    subscribe(RTNLGRP_LINK, move |kind, msg| {
        let event = match (kind, link_of(kind, msg)) {
            (NLMSG_OVERRUN, _) => LinkEvent {
                ifindex: LinkEvent::LOST,
                now: None,
            },
            (_, Some(now)) => LinkEvent {
                ifindex: now.index,
                now: Some(now),
            },
            (RTM_DELLINK, None) if msg.len() >= 24 => LinkEvent {
                ifindex: u32_at(msg, 20),
                now: None,
            },
            _ => return true,
        };
        tx.send(event).is_ok()
    })
}

/// Reads the announcements of multicast group `group` on a socket of its
/// own, on the runtime the caller runs in, and hands each message (type,
/// bytes with the header) to `each` until it returns false. Parsed by hand
/// for the few fields wanted: every TAP the pool creates, takes, moves and
/// deletes is announced, and a full parse of each (counters, IPv6 and
/// per-protocol attributes) was a visible part of a pair's CPU. Lost
/// announcements (a full receive queue) are logged and reported to `each`
/// as one message of type [`NLMSG_OVERRUN`] with no bytes, so the reader can
/// look again at what it follows.
fn subscribe(
    group: u32,
    mut each: impl FnMut(u16, &[u8]) -> bool + Send + 'static,
) -> Result<(), NetlinkError> {
    use rtnetlink::sys::{AsyncSocket, AsyncSocketExt, TokioSocket, protocols::NETLINK_ROUTE};
    let rt = tokio::runtime::Handle::try_current().map_err(|_| NetlinkError::NoRuntime)?;
    let _in_rt = rt.enter();
    let mut sock = TokioSocket::new(NETLINK_ROUTE).map_err(NetlinkError::Connect)?;
    sock.socket_mut()
        .bind_auto()
        .map_err(NetlinkError::Connect)?;
    sock.socket_ref()
        .add_membership(group)
        .map_err(NetlinkError::Connect)?;
    rt.spawn(async move {
        loop {
            let data = match sock.recv_from_full().await {
                Ok((data, _)) => data,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    tracing::warn!(group, "netlink announcements lost (receive queue full)");
                    if !each(NLMSG_OVERRUN, &[]) {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::warn!(group, error = %e, "netlink announcements: socket failed; no longer followed");
                    return;
                }
            };
            for msg in messages(&data) {
                let Ok((kind, msg)) = msg else { break };
                if !each(kind, msg) {
                    return;
                }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::LinkChange;
    use super::super::tests::{add_bridge, in_netns, up};
    use super::*;

    async fn next<T>(rx: &mut tokio::sync::mpsc::UnboundedReceiver<T>, what: &str) -> T {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no announcement: {what}"))
            .expect("watcher running")
    }

    fn tc(args: &[&str]) {
        let st = std::process::Command::new("tc")
            .args(args)
            .status()
            .expect("tc runs");
        assert!(st.success(), "tc {args:?}");
    }

    /// The hand-parsed announcements carry what the agent reads: a link's
    /// name, state and MTU, its deletion, a qdisc's removal with its kind.
    #[test]
    fn link_and_tc_announcements_are_parsed() {
        in_netns("link_and_tc_announcements_are_parsed", |nl| async move {
            let (ltx, mut links) = tokio::sync::mpsc::unbounded_channel();
            let (ttx, mut tcs) = tokio::sync::mpsc::unbounded_channel();
            watch_links(ltx).expect("link watcher");
            watch_tc_removals(ttx).expect("tc watcher");
            let index = add_bridge(&nl, "wt0", 0).await;
            let ev = next(&mut links, "created").await;
            let now = ev.now.expect("a new link");
            assert_eq!(
                (ev.ifindex, now.name.as_str(), now.up),
                (index, "wt0", false)
            );
            assert_eq!(now.kind.as_deref(), Some("bridge"));
            let change = LinkChange {
                mtu: Some(1280),
                ..up(true)
            };
            nl.set_link(index, change).await.expect("up");
            // The first announcement showing it up carries the new MTU.
            loop {
                let ev = next(&mut links, "set up").await;
                let now = ev.now.expect("still there");
                if now.up {
                    assert_eq!((ev.ifindex, now.mtu), (index, 1280));
                    break;
                }
            }
            tc(&["qdisc", "add", "dev", "wt0", "clsact"]);
            tc(&["qdisc", "del", "dev", "wt0", "clsact"]);
            let removal = next(&mut tcs, "qdisc removed").await;
            assert_eq!(
                removal,
                TcRemoval {
                    ifindex: index,
                    what: "qdisc clsact".into()
                }
            );
            nl.delete_link(index).await.expect("delete");
            loop {
                let ev = next(&mut links, "deleted").await;
                if ev.now.is_none() {
                    assert_eq!(ev.ifindex, index);
                    break;
                }
            }
        });
    }

    /// Announcements the kernel could not queue (the reader fell behind)
    /// are reported, so the agent looks at its devices again instead of
    /// missing a deletion for good.
    #[test]
    fn lost_link_announcements_are_reported() {
        in_netns("lost_link_announcements_are_reported", |nl| async move {
            let (ltx, mut links) = tokio::sync::mpsc::unbounded_channel();
            watch_links(ltx).expect("link watcher");
            let index = add_bridge(&nl, "wt1", 0).await;
            // This thread runs the watcher too: while it sends, nothing
            // reads, and the socket's queue (~200 KiB) overflows.
            for i in 0..4000u32 {
                let change = LinkChange {
                    mtu: Some(1280 + i % 200),
                    ..Default::default()
                };
                nl.set_link_now(index, change).expect("mtu");
            }
            loop {
                let ev = next(&mut links, "lost announcements").await;
                if ev.ifindex == LinkEvent::LOST {
                    assert!(ev.now.is_none());
                    break;
                }
            }
        });
    }
}
