//! Thin, typed wrapper around `rtnetlink` (NETLINK_ROUTE) for the operations the
//! network agent needs: listing / renaming / deleting links (including batch
//! deletion by link group), creating the pool gateway device, permanent
//! neighbour entries, and a few read-only queries (addresses, routes, the
//! default uplink).
//!
//! Every kernel operation is logged with `tracing::debug!`. Errors carry the
//! action that failed plus the underlying [`rtnetlink::Error`]; use
//! [`NetlinkError::errno`] to inspect the kernel errno.
//!
//! [`Netlink::new`] runs the socket on a thread of its own (`netlink`): a
//! request to NETLINK_ROUTE does its kernel work, RTNL lock included, inside
//! the `sendmsg` of the sender, so that call must not run on the async
//! workers that serve the bus (a slow or contended RTNL would stall every
//! caller). The thread inherits, and the socket lives in, the network
//! namespace of the *thread* that calls `new`; it ends when the last handle
//! is dropped.

use std::net::{IpAddr, Ipv4Addr};

use futures::stream::TryStreamExt;
use rtnetlink::packet_route::{
    AddressFamily,
    address::AddressAttribute,
    link::{LinkAttribute, LinkFlags, LinkInfo as NlLinkInfo, LinkMessage},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
};
use rtnetlink::{
    Handle, LinkBridge, LinkDummy, LinkMessageBuilder, LinkUnspec, RouteMessageBuilder,
};
use tracing::debug;

mod request;

/// Errors from netlink operations. Each variant names the action that failed.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("failed to open NETLINK_ROUTE socket")]
    Connect(#[source] std::io::Error),
    #[error("Netlink::new called outside a tokio runtime")]
    NoRuntime,
    #[error("failed to dump {what}")]
    Dump {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to dump {what}")]
    RawDump {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to get link {what}")]
    LinkGet {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to set link {index}")]
    LinkSet {
        index: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to delete link {index}")]
    LinkDel {
        index: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to create veth {host} (peer {peer} in the container's namespace)")]
    VethAdd {
        host: String,
        peer: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("veth {name} vanished right after creation")]
    VethMissing { name: String },
    #[error("refusing to delete link group 0 (the default group of every link)")]
    GroupZero,
    #[error("failed to delete link group {group}")]
    GroupDel {
        group: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to create gateway device {name}")]
    GatewayCreate {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("gateway device {name} vanished right after creation")]
    GatewayMissing { name: String },
    #[error("failed to add address {addr}/{prefix_len} to link {index}")]
    AddrAdd {
        index: u32,
        addr: IpAddr,
        prefix_len: u8,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add the default route via {gateway} on link {oif}")]
    RouteAdd {
        gateway: Ipv4Addr,
        oif: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add the route to {dest}/{prefix_len} on link {oif}")]
    Route6Add {
        dest: std::net::Ipv6Addr,
        prefix_len: u8,
        oif: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add neighbour {ip} on link {ifindex}")]
    NeighAdd {
        ifindex: u32,
        ip: IpAddr,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to delete neighbour {ip} on link {ifindex}")]
    NeighDel {
        ifindex: u32,
        ip: IpAddr,
        #[source]
        source: rtnetlink::Error,
    },
}

impl NetlinkError {
    /// The kernel errno (positive, e.g. `libc::ENODEV`) if the kernel rejected the request.
    pub fn errno(&self) -> Option<i32> {
        use std::error::Error as _;
        self.source()
            .and_then(|s| s.downcast_ref::<rtnetlink::Error>())
            .and_then(errno_of)
    }
}

/// Positive errno carried by a netlink error reply, if any.
fn errno_of(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    errno_of(e) == Some(errno)
}

/// A network interface as reported by RTM_GETLINK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` ("tun", "bridge", "dummy", "veth", ...); `None` for e.g. `lo`
    /// or physical NICs.
    pub kind: Option<String>,
    pub group: u32,
    /// `IFF_UP` (administrative state).
    pub up: bool,
    pub mtu: u32,
    /// `IFLA_ADDRESS`, for Ethernet-like links.
    pub mac: Option<[u8; 6]>,
    /// `IFLA_IFALIAS` (what `ip link` shows as "alias").
    pub alias: Option<String>,
    /// `IFLA_STATS64`, the device's own counters (the kernel sends them
    /// with every link message; zero from [`Netlink::list_links`], which
    /// dumps without them).
    pub counters: LinkCounters,
}

/// A device's counters as the kernel keeps them (`IFLA_STATS64`), from
/// the device's point of view: `rx` is what the device received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounters {
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_dropped: u64,
}

impl LinkInfo {
    fn from_msg(msg: &LinkMessage) -> Self {
        let mut info = LinkInfo {
            index: msg.header.index,
            name: String::new(),
            kind: None,
            group: 0,
            up: msg.header.flags.contains(LinkFlags::Up),
            mtu: 0,
            mac: None,
            alias: None,
            counters: LinkCounters::default(),
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::Stats64(st) => {
                    info.counters = LinkCounters {
                        rx_bytes: st.rx_bytes,
                        rx_packets: st.rx_packets,
                        rx_dropped: st.rx_dropped,
                        tx_bytes: st.tx_bytes,
                        tx_packets: st.tx_packets,
                        tx_dropped: st.tx_dropped,
                    }
                }
                LinkAttribute::IfName(n) => info.name.clone_from(n),
                LinkAttribute::Mtu(m) => info.mtu = *m,
                LinkAttribute::Group(g) => info.group = *g,
                LinkAttribute::IfAlias(a) => info.alias = Some(a.clone()),
                LinkAttribute::Address(a) => info.mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        if let NlLinkInfo::Kind(k) = i {
                            info.kind = Some(k.to_string());
                        }
                    }
                }
                _ => {}
            }
        }
        info
    }
}

/// Attributes to change in one [`Netlink::set_link`] call; `None` = leave as is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkChange {
    pub name: Option<String>,
    pub mtu: Option<u32>,
    pub up: Option<bool>,
    pub group: Option<u32>,
    /// `IFLA_IFALIAS`: the pool marks its TAPs with it (see `agent::pool`).
    pub alias: Option<&'static str>,
}

impl LinkChange {
    fn is_empty(&self) -> bool {
        self.name.is_none()
            && self.mtu.is_none()
            && self.up.is_none()
            && self.group.is_none()
            && self.alias.is_none()
    }
}

/// Cheaply clonable handle to a NETLINK_ROUTE connection.
///
/// A NETLINK_ROUTE socket runs one dump at a time: a second dump started
/// while one is in progress fails with EBUSY. Every dump therefore takes
/// `dumps` first, so concurrent callers (Reconcile next to Reconcile,
/// Health next to recovery) wait instead of failing.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
    dumps: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Blocking requests made by the calling thread (see [`request`]).
    requests: std::sync::Arc<request::Requests>,
}

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
fn poke_on(
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

impl Netlink {
    /// Opens a NETLINK_ROUTE socket served by a thread of its own (see the
    /// module documentation), in the calling thread's network namespace.
    pub fn new() -> Result<Self, NetlinkError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("netlink".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    match rtnetlink::new_connection() {
                        Ok((conn, handle, messages)) => {
                            let _ = tx.send(Ok(handle));
                            // The connection ends once every handle is gone
                            // *and* nobody takes unsolicited messages: kept,
                            // this receiver would keep the thread forever.
                            drop(messages);
                            conn.await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(NetlinkError::Connect)?;
        let handle = rx
            .recv()
            .map_err(|_| NetlinkError::Connect(std::io::Error::other("netlink thread died")))?
            .map_err(NetlinkError::Connect)?;
        let requests = request::Requests::new().map_err(NetlinkError::Connect)?;
        debug!("netlink connection opened");
        Ok(Self {
            handle,
            dumps: Default::default(),
            requests: std::sync::Arc::new(requests),
        })
    }

    /// All links in the namespace.
    pub async fn list_links(&self) -> Result<Vec<LinkInfo>, NetlinkError> {
        debug!("dump links");
        tokio::task::spawn_blocking(link_dump)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r)
            .map_err(|source| NetlinkError::RawDump {
                what: "links",
                source,
            })
    }

    /// The link named `name`, or `None` if there is none (ENODEV).
    pub async fn link_by_name(&self, name: &str) -> Result<Option<LinkInfo>, NetlinkError> {
        debug!(name, "get link by name");
        let res = self
            .handle
            .link()
            .get()
            .match_name(name)
            .execute()
            .try_next()
            .await;
        match res {
            Ok(m) => Ok(m.map(|m| LinkInfo::from_msg(&m))),
            Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
            Err(source) => Err(NetlinkError::LinkGet {
                what: name.to_string(),
                source,
            }),
        }
    }

    /// The link with ifindex `index`, or `None` if there is none (ENODEV).
    pub async fn link_by_index(&self, index: u32) -> Result<Option<LinkInfo>, NetlinkError> {
        debug!(index, "get link by index");
        let res = self
            .handle
            .link()
            .get()
            .match_index(index)
            .execute()
            .try_next()
            .await;
        match res {
            Ok(m) => Ok(m.map(|m| LinkInfo::from_msg(&m))),
            Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
            Err(source) => Err(NetlinkError::LinkGet {
                what: index.to_string(),
                source,
            }),
        }
    }

    /// No IPv6 address generation on the (still down) link `index`
    /// (`addr_gen_mode none`): brought up, it gets no link-local address,
    /// so it sends no DAD, router solicitation or MLD report. Netlink, not
    /// /proc/sys (read-only in many containers).
    pub async fn ipv6_quiet(&self, index: u32) -> Result<(), NetlinkError> {
        use rtnetlink::packet_route::link::{AfSpecInet6, AfSpecUnspec, In6AddrGenMode};
        let mut msg = LinkUnspec::new_with_index(index).build();
        msg.attributes
            .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
                vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
            )]));
        self.handle
            .link()
            .change(msg)
            .execute()
            .await
            .map_err(|source| NetlinkError::LinkSet { index, source })
    }

    /// One RTM_NEWLINK (set) carrying whichever attributes are Some: new name, mtu,
    /// up/down, group. (Kernel applies name before flags, so rename+up in one message
    /// works on a down link.) An empty change sends nothing.
    pub async fn set_link(&self, index: u32, change: LinkChange) -> Result<(), NetlinkError> {
        debug!(index, ?change, "set link");
        if change.is_empty() {
            return Ok(());
        }
        // `change` = RTM_NEWLINK with NLM_F_REQUEST|NLM_F_ACK (no CREATE/EXCL):
        // the kernel runs do_setlink() on the existing device.
        self.handle
            .link()
            .change(request::link_change_msg(index, change))
            .execute()
            .await
            .map_err(|source| NetlinkError::LinkSet { index, source })
    }

    /// Creates a veth pair in one RTM_NEWLINK: the host end `host` here
    /// (down, MTU `mtu`), the peer `peer` directly in the network namespace
    /// `netns` (IFLA_NET_NS_FD in the peer's message: the agent never
    /// enters that namespace) with MAC `peer_mac` and the same MTU. Returns
    /// the host end's ifindex. EEXIST: `host` here or `peer` there exists.
    pub async fn create_veth(
        &self,
        host: &str,
        mtu: u32,
        peer: &str,
        peer_mac: [u8; 6],
        netns: std::os::fd::BorrowedFd<'_>,
    ) -> Result<u32, NetlinkError> {
        use rtnetlink::packet_route::link::{InfoData, InfoVeth};
        use std::os::fd::AsRawFd;
        debug!(host, peer, mtu, "create veth");
        let peer_msg = LinkMessageBuilder::<LinkUnspec>::new()
            .name(peer.to_string())
            .mtu(mtu)
            .address(peer_mac.to_vec())
            .setns_by_fd(netns.as_raw_fd())
            .build();
        let msg = LinkMessageBuilder::<rtnetlink::LinkVeth>::new_with_info_kind(
            rtnetlink::packet_route::link::InfoKind::Veth,
        )
        .name(host.to_string())
        .mtu(mtu)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg)))
        .build();
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|source| NetlinkError::VethAdd {
                host: host.into(),
                peer: peer.into(),
                source,
            })?;
        match self.link_by_name(host).await? {
            Some(l) => Ok(l.index),
            None => Err(NetlinkError::VethMissing { name: host.into() }),
        }
    }

    /// Creates a veth pair `name` ↔ `peer`, both in this namespace, with
    /// MTU `mtu` on both (down). Returns `name`'s ifindex.
    pub async fn create_veth_pair(
        &self,
        name: &str,
        peer: &str,
        mtu: u32,
    ) -> Result<u32, NetlinkError> {
        debug!(name, peer, mtu, "create veth pair");
        self.handle
            .link()
            .add(rtnetlink::LinkVeth::new(name, peer).mtu(mtu).build())
            .execute()
            .await
            .map_err(|source| NetlinkError::VethAdd {
                host: name.into(),
                peer: peer.into(),
                source,
            })?;
        let Some(p) = self.link_by_name(peer).await? else {
            return Err(NetlinkError::VethMissing { name: peer.into() });
        };
        self.set_link(
            p.index,
            LinkChange {
                mtu: Some(mtu),
                ..Default::default()
            },
        )
        .await?;
        match self.link_by_name(name).await? {
            Some(l) => Ok(l.index),
            None => Err(NetlinkError::VethMissing { name: name.into() }),
        }
    }

    /// Deletes one link (RTM_DELLINK). ENODEV is reported as an error.
    pub async fn delete_link(&self, index: u32) -> Result<(), NetlinkError> {
        debug!(index, "delete link");
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(|source| NetlinkError::LinkDel { index, source })
    }

    /// RTM_DELLINK with ifindex 0 and IFLA_GROUP = group: deletes every link of that
    /// group in one go (one RCU grace period for the whole batch). Returns Ok if none
    /// existed (ENODEV). Group 0 (the default group) is refused. The kernel refuses
    /// the whole batch (EOPNOTSUPP) if any member cannot be deleted via rtnetlink.
    pub async fn delete_group(&self, group: u32) -> Result<(), NetlinkError> {
        debug!(group, "delete link group");
        if group == 0 {
            return Err(NetlinkError::GroupZero);
        }
        let msg = LinkMessageBuilder::<LinkUnspec>::new()
            .link_group(group)
            .build();
        match self.handle.link().del_with_message(msg).execute().await {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::ENODEV) => {
                debug!(group, "link group was empty");
                Ok(())
            }
            Err(source) => Err(NetlinkError::GroupDel { group, source }),
        }
    }

    /// Creates (idempotently) the gateway device: kind "dummy" if the kernel supports
    /// it, else a bridge with no ports. An existing link with that name is kept
    /// (whatever its kind). Sets it up and adds `addr/prefix_len` if not already
    /// present, which makes the kernel install the connected route for the pool
    /// CIDR on this device. Returns the link and the kind in use.
    pub async fn ensure_gateway_device(
        &self,
        name: &str,
        addr: Ipv4Addr,
        prefix_len: u8,
    ) -> Result<(LinkInfo, String), NetlinkError> {
        self.ensure_gateway_device_with_mtu(name, addr, prefix_len, None)
            .await
    }

    /// [`Self::ensure_gateway_device`], additionally setting the MTU if `mtu` is Some.
    pub async fn ensure_gateway_device_with_mtu(
        &self,
        name: &str,
        addr: Ipv4Addr,
        prefix_len: u8,
        mtu: Option<u32>,
    ) -> Result<(LinkInfo, String), NetlinkError> {
        let link = match self.link_by_name(name).await? {
            Some(l) => {
                debug!(name, index = l.index, kind = ?l.kind, "gateway device exists");
                l
            }
            None => {
                self.create_gateway(name).await?;
                self.link_by_name(name)
                    .await?
                    .ok_or_else(|| NetlinkError::GatewayMissing {
                        name: name.to_string(),
                    })?
            }
        };
        let kind = link.kind.clone().unwrap_or_else(|| "unknown".to_string());

        let change = LinkChange {
            up: (!link.up).then_some(true),
            mtu: mtu.filter(|m| *m != link.mtu),
            ..Default::default()
        };
        self.set_link(link.index, change).await?;

        if !self
            .ipv4_addrs(link.index)
            .await?
            .contains(&(addr, prefix_len))
        {
            self.add_ipv4_addr(link.index, addr, prefix_len).await?;
        }

        let link =
            self.link_by_index(link.index)
                .await?
                .ok_or_else(|| NetlinkError::GatewayMissing {
                    name: name.to_string(),
                })?;
        Ok((link, kind))
    }

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

    /// Every neighbour entry of the node (of `family` only, when given),
    /// one dump at a time.
    async fn neigh_dump(
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
    async fn replace_route_with_mtu(
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

    /// Creates `name` as a dummy, falling back to a port-less bridge when the kernel
    /// has no dummy driver. EEXIST (lost a race) counts as success.
    async fn create_gateway(&self, name: &str) -> Result<(), NetlinkError> {
        debug!(name, kind = "dummy", "create gateway device");
        let err = match self
            .handle
            .link()
            .add(LinkDummy::new(name).build())
            .execute()
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => return Ok(()),
            Err(e) => e,
        };
        // Unknown IFLA_INFO_KIND -> EOPNOTSUPP ("Unknown device type"); module
        // loading problems can surface as ENOENT / EPROTONOSUPPORT.
        let unsupported = matches!(
            errno_of(&err),
            Some(libc::EOPNOTSUPP | libc::ENOENT | libc::EPROTONOSUPPORT | libc::ENODEV)
        );
        if !unsupported {
            return Err(NetlinkError::GatewayCreate {
                name: name.to_string(),
                source: err,
            });
        }
        debug!(name, error = %err, "dummy unsupported, falling back to bridge");
        match self
            .handle
            .link()
            .add(LinkBridge::new(name).build())
            .execute()
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
            Err(source) => Err(NetlinkError::GatewayCreate {
                name: name.to_string(),
                source,
            }),
        }
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
        let mut msg = NeighbourMessage::default();
        msg.header.ifindex = ifindex;
        let (family, addr) = match ip {
            IpAddr::V4(v4) => (AddressFamily::Inet, NeighbourAddress::Inet(v4)),
            IpAddr::V6(v6) => (AddressFamily::Inet6, NeighbourAddress::Inet6(v6)),
        };
        msg.header.family = family;
        msg.attributes.push(NeighbourAttribute::Destination(addr));
        match self.handle.neighbours().del(msg).execute().await {
            Ok(()) => Ok(true),
            Err(e) if is_errno(&e, libc::ENOENT) || is_errno(&e, libc::ENODEV) => Ok(false),
            Err(source) => Err(NetlinkError::NeighDel {
                ifindex,
                ip,
                source,
            }),
        }
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

    async fn ipv4_routes(&self) -> Result<Vec<RouteMessage>, NetlinkError> {
        let req = RouteMessageBuilder::<Ipv4Addr>::new().build();
        self.route_dump(req, "ipv4 routes").await
    }

    /// Every route of the family `req` asks for.
    async fn route_dump(
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
    async fn addr_dump(
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
    async fn ipv4_addr_dump(
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

fn mask(a: Ipv4Addr, prefix_len: u8) -> Ipv4Addr {
    let m = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(u32::from(a) & m)
}

fn route_table(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn route_metric(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// RTA_OIF, or the first multipath next hop's interface.
fn route_oif(r: &RouteMessage) -> Option<u32> {
    r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
        _ => None,
    })
}

fn route_dst(r: &RouteMessage) -> Ipv4Addr {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(*v4),
            _ => None,
        })
        .unwrap_or(Ipv4Addr::UNSPECIFIED)
}

/// Sends one dump request (`kind`, then `body` after the nlmsghdr) on a
/// fresh NETLINK_ROUTE socket and hands each reply message (its type and
/// bytes, header included) to `each`, until NLMSG_DONE. For dumps a full
/// parse into netlink-packet-route's types made slow at 10,000 devices.
/// Blocking: call it off the async workers.
fn raw_dump(kind: u16, body: &[u8], mut each: impl FnMut(u16, &[u8])) -> std::io::Result<()> {
    use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR};
    use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
    const SEQ: u32 = 1;
    let mut req = Vec::with_capacity(16 + body.len());
    req.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    req.extend_from_slice(&kind.to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&SEQ.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(body);
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    sock.send(&req, 0)?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    loop {
        let (data, _) = sock.recv_from_full()?;
        let mut at = 0;
        while at + 16 <= data.len() {
            let len = u32_at(&data, at) as usize;
            let kind = u16_at(&data, at + 4);
            if len < 16 || at + len > data.len() {
                return Err(bad("truncated netlink message"));
            }
            let msg = &data[at..at + len];
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = if len >= 20 { u32_at(msg, 16) as i32 } else { 0 };
                    if code != 0 {
                        return Err(std::io::Error::from_raw_os_error(-code));
                    }
                }
                _ if u32_at(msg, 8) == SEQ => each(kind, msg),
                _ => {}
            }
            at += (len + 3) & !3;
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The attributes of a netlink message from byte `from` on, as (type
/// without the nested/byte-order flags, payload).
fn attrs(msg: &[u8], from: usize) -> impl Iterator<Item = (u16, &[u8])> {
    let mut a = from;
    std::iter::from_fn(move || {
        if a + 4 > msg.len() {
            return None;
        }
        let alen = u16_at(msg, a) as usize;
        let akind = u16_at(msg, a + 2) & 0x3fff;
        if alen < 4 || a + alen > msg.len() {
            return None;
        }
        let payload = &msg[a + 4..a + alen];
        a += (alen + 3) & !3;
        Some((akind, payload))
    })
}

/// A NUL-terminated netlink string attribute.
fn nl_str(payload: &[u8]) -> String {
    let end = payload
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(payload.len());
    String::from_utf8_lossy(&payload[..end]).into_owned()
}

/// Every device in this namespace from one `RTM_GETLINK` dump without
/// the counters (`RTEXT_FILTER_SKIP_STATS`; [`LinkInfo::counters`] stay
/// zero), parsed for the fields [`LinkInfo`] has only: at 10,000 TAPs the
/// full parse through netlink-packet-route took ~170 ms of a restart.
/// Blocking: call it off the async workers.
pub fn link_dump() -> std::io::Result<Vec<LinkInfo>> {
    const RTM_NEWLINK: u16 = 16;
    const RTM_GETLINK: u16 = 18;
    // linux/if_link.h, linux/rtnetlink.h
    const IFLA_ADDRESS: u16 = 1;
    const IFLA_IFNAME: u16 = 3;
    const IFLA_MTU: u16 = 4;
    const IFLA_LINKINFO: u16 = 18;
    const IFLA_INFO_KIND: u16 = 1;
    const IFLA_IFALIAS: u16 = 20;
    const IFLA_GROUP: u16 = 27;
    const IFLA_EXT_MASK: u16 = 29;
    const RTEXT_FILTER_SKIP_STATS: u32 = 1 << 3;
    // ifinfomsg (16, all zero: every family, every device) +
    // IFLA_EXT_MASK (8).
    let mut body = vec![0u8; 16];
    body.extend_from_slice(&8u16.to_ne_bytes());
    body.extend_from_slice(&IFLA_EXT_MASK.to_ne_bytes());
    body.extend_from_slice(&RTEXT_FILTER_SKIP_STATS.to_ne_bytes());
    let mut out = Vec::new();
    raw_dump(RTM_GETLINK, &body, |kind, msg| {
        if kind != RTM_NEWLINK || msg.len() < 32 {
            return;
        }
        let mut info = LinkInfo {
            index: u32_at(msg, 20),
            name: String::new(),
            kind: None,
            group: 0,
            up: u32_at(msg, 24) & libc::IFF_UP as u32 != 0,
            mtu: 0,
            mac: None,
            alias: None,
            counters: LinkCounters::default(),
        };
        for (akind, p) in attrs(msg, 32) {
            match akind {
                IFLA_IFNAME => info.name = nl_str(p),
                IFLA_MTU if p.len() >= 4 => info.mtu = u32_at(p, 0),
                IFLA_GROUP if p.len() >= 4 => info.group = u32_at(p, 0),
                IFLA_IFALIAS => info.alias = Some(nl_str(p)),
                IFLA_ADDRESS => info.mac = <[u8; 6]>::try_from(p).ok(),
                IFLA_LINKINFO => {
                    info.kind = attrs(p, 0)
                        .find(|(k, _)| *k == IFLA_INFO_KIND)
                        .map(|(_, k)| nl_str(k));
                }
                _ => {}
            }
        }
        out.push(info);
    })?;
    Ok(out)
}

/// Every device's counters in this namespace, by ifindex, from one
/// `RTM_GETSTATS` dump asking only for `IFLA_STATS_LINK_64`: a fraction of
/// what an `RTM_GETLINK` dump makes the kernel fill in and us parse (the
/// metrics walk every sandbox device at each scrape). Blocking: call it
/// off the async workers.
pub fn link_counters_dump() -> std::io::Result<std::collections::HashMap<u32, LinkCounters>> {
    // Not in netlink-packet-route 0.34 (linux/rtnetlink.h, if_link.h).
    const RTM_NEWSTATS: u16 = 92;
    const RTM_GETSTATS: u16 = 94;
    const IFLA_STATS_LINK_64: u16 = 1;
    // if_stats_msg (12): family, pads, ifindex 0 (all), filter_mask =
    // 1 << (IFLA_STATS_LINK_64 - 1).
    let mut body = vec![0u8; 8];
    body.extend_from_slice(&(1u32 << (IFLA_STATS_LINK_64 - 1)).to_ne_bytes());
    let mut out = std::collections::HashMap::new();
    raw_dump(RTM_GETSTATS, &body, |kind, msg| {
        if kind != RTM_NEWSTATS || msg.len() < 28 {
            return;
        }
        let ifindex = u32_at(msg, 20);
        // struct rtnl_link_stats64: rx_packets, tx_packets, rx_bytes,
        // tx_bytes, rx_errors, tx_errors, rx_dropped, tx_dropped, ...
        if let Some((_, p)) =
            attrs(msg, 28).find(|(k, p)| *k == IFLA_STATS_LINK_64 && p.len() >= 8 * 8)
        {
            out.insert(
                ifindex,
                LinkCounters {
                    rx_packets: u64_at(p, 0),
                    tx_packets: u64_at(p, 8),
                    rx_bytes: u64_at(p, 16),
                    tx_bytes: u64_at(p, 24),
                    rx_dropped: u64_at(p, 48),
                    tx_dropped: u64_at(p, 56),
                },
            );
        }
    })?;
    Ok(out)
}

/// Whether a network device with this ifindex exists in our namespace.
/// (nix 0.30's `if_indextoname` treats only -1 as failure, but libc returns
/// NULL for an unknown index, so it called every device alive and
/// the datapath's `tap_attached` leaked an entry per retired TAP.)
pub fn link_exists(ifindex: u32) -> bool {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as if_indextoname(3) requires;
    // it only writes the name there.
    !unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) }.is_null()
}

#[cfg(test)]
mod tests {
    /// Thread ids of this process named `name`.
    fn threads_named(name: &str) -> std::collections::BTreeSet<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?;
                let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
                (comm.trim() == name).then(|| t.file_name().to_string_lossy().into_owned())
            })
            .collect()
    }

    #[test]
    fn a_connection_thread_ends_with_its_last_handle() {
        // Other tests of this binary may hold connections: follow ours.
        let before = threads_named("netlink");
        let nl = super::Netlink::new().unwrap();
        let second = nl.clone();
        let ours: Vec<String> = threads_named("netlink")
            .difference(&before)
            .cloned()
            .collect();
        assert!(!ours.is_empty(), "no netlink thread was started");
        drop(nl);
        drop(second);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ours
            .iter()
            .any(|tid| std::path::Path::new("/proc/self/task").join(tid).exists())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the netlink thread outlived its handles"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    use super::*;
    use rtnetlink::LinkVeth;
    use std::future::Future;
    use std::time::Instant;

    /// Runs `body` on a dedicated thread inside a fresh, empty network namespace
    /// (unshare(CLONE_NEWNET) affects only that thread), with `lo` up and a
    /// current-thread tokio runtime. The namespace dies with the thread, so cleanup
    /// happens even if the body panics; the panic is propagated via `join`.
    pub(super) fn in_netns<F, Fut>(test: &str, body: F)
    where
        F: FnOnce(Netlink) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        // (`nix::unistd::geteuid` needs nix's "user" feature, which we don't enable.)
        // SAFETY: geteuid() has no preconditions, cannot fail and touches no memory.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            // The tests' rule (tests/common/mod.rs): never a silent skip in CI.
            let ci =
                std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
            assert!(!ci, "{test} needs root; CI must run as root");
            eprintln!("SKIPPED {test}: needs root to unshare a network namespace");
            return;
        }
        let res = std::thread::spawn(move || {
            // Equivalent to `nix::sched::unshare(CloneFlags::CLONE_NEWNET)`, but via libc
            // because the daemon's nix dependency does not enable the "sched" feature.
            // SAFETY: unshare() only takes an integer flag set and affects just this thread.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            );
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let nl = Netlink::new().expect("netlink socket");
                let links = nl.list_links().await.expect("list links");
                // Guard: we must be in a brand-new namespace, never the host's.
                assert_eq!(links.len(), 1, "fresh netns should only have lo: {links:?}");
                assert_eq!(links[0].name, "lo");
                nl.set_link(links[0].index, up(true)).await.expect("lo up");
                body(nl).await;
            });
        })
        .join();
        if let Err(panic) = res {
            std::panic::resume_unwind(panic);
        }
    }

    fn up(on: bool) -> LinkChange {
        LinkChange {
            up: Some(on),
            ..Default::default()
        }
    }

    pub(super) async fn add_bridge(nl: &Netlink, name: &str, group: u32) -> u32 {
        nl.handle
            .link()
            .add(
                LinkMessageBuilder::<LinkBridge>::new(name) // created down
                    .link_group(group)
                    .build(),
            )
            .execute()
            .await
            .expect("add bridge");
        nl.link_by_name(name)
            .await
            .expect("get bridge")
            .expect("bridge exists")
            .index
    }

    async fn add_veth(nl: &Netlink, name: &str, peer: &str) -> u32 {
        nl.handle
            .link()
            .add(LinkVeth::new(name, peer).build())
            .execute()
            .await
            .expect("add veth");
        for n in [name, peer] {
            let l = nl.link_by_name(n).await.expect("get").expect("exists");
            nl.set_link(l.index, up(true)).await.expect("veth up");
        }
        nl.link_by_name(name)
            .await
            .expect("get")
            .expect("exists")
            .index
    }

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
    fn link_by_name_missing_is_none() {
        in_netns("link_by_name_missing_is_none", |nl| async move {
            assert_eq!(nl.link_by_name("nope0").await.expect("query"), None);
            let lo = nl.link_by_name("lo").await.expect("query").expect("lo");
            assert!(lo.up);
            assert_eq!(lo.kind, None);
            let err = nl.delete_link(9999).await.expect_err("no such link");
            assert_eq!(err.errno(), Some(libc::ENODEV));
        });
    }

    #[test]
    fn gateway_device() {
        in_netns("gateway_device", |nl| async move {
            let gw = Ipv4Addr::new(10, 244, 0, 1);
            let (link, kind) = nl
                .ensure_gateway_device("cube-gw0", gw, 18)
                .await
                .expect("ensure gateway");
            eprintln!("gateway device kind used by this kernel: {kind}");
            assert!(kind == "dummy" || kind == "bridge", "kind {kind}");
            assert_eq!(link.kind.as_deref(), Some(kind.as_str()));
            assert_eq!(link.name, "cube-gw0");
            assert!(link.up);
            assert_eq!(
                nl.ipv4_addrs(link.index).await.expect("addrs"),
                vec![(gw, 18)]
            );
            assert!(
                nl.route_exists(Ipv4Addr::new(10, 244, 0, 0), 18, link.index)
                    .await
                    .expect("routes"),
                "connected route for the pool /18 missing"
            );
            assert!(
                !nl.route_exists(Ipv4Addr::new(10, 244, 0, 0), 16, link.index)
                    .await
                    .expect("routes")
            );

            // Idempotent; also applies an MTU when asked.
            let (again, kind2) = nl
                .ensure_gateway_device_with_mtu("cube-gw0", gw, 18, Some(1400))
                .await
                .expect("ensure gateway again");
            assert_eq!(kind2, kind);
            assert_eq!(again.index, link.index);
            assert_eq!(again.mtu, 1400);
            assert_eq!(
                nl.ipv4_addrs(link.index).await.expect("addrs"),
                vec![(gw, 18)]
            );

            // An existing link of another kind is kept as is.
            let idx = add_veth(&nl, "keep0", "keep1").await;
            let (kept, kind3) = nl
                .ensure_gateway_device("keep0", Ipv4Addr::new(10, 245, 0, 1), 24)
                .await
                .expect("ensure existing");
            assert_eq!((kept.index, kind3.as_str()), (idx, "veth"));
        });
    }

    #[test]
    fn set_link_rename_mtu_up_then_down() {
        in_netns("set_link_rename_mtu_up_then_down", |nl| async move {
            let idx = add_bridge(&nl, "tb0", 0).await;
            let before = nl.link_by_name("tb0").await.expect("get").expect("tb0");
            assert!(!before.up);
            nl.set_link(
                idx,
                LinkChange {
                    name: Some("tb-renamed".into()),
                    mtu: Some(1400),
                    up: Some(true),
                    group: Some(42),
                    alias: Some("cube test"),
                },
            )
            .await
            .expect("rename+mtu+up+group+alias");
            assert_eq!(nl.link_by_name("tb0").await.expect("get"), None);
            let after = nl
                .link_by_name("tb-renamed")
                .await
                .expect("get")
                .expect("renamed");
            assert_eq!(
                (after.index, after.mtu, after.up, after.group),
                (idx, 1400, true, 42)
            );
            assert_eq!(after.alias.as_deref(), Some("cube test"));
            assert_eq!(after.kind.as_deref(), Some("bridge"));
            nl.set_link(idx, up(false)).await.expect("down");
            let down = nl.link_by_index(idx).await.expect("get").expect("exists");
            assert!(!down.up);
            assert_eq!(down.mtu, 1400);
            // Empty change is a no-op.
            nl.set_link(idx, LinkChange::default()).await.expect("noop");
            let err = nl.set_link(9999, up(true)).await.expect_err("missing link");
            assert_eq!(err.errno(), Some(libc::ENODEV));
        });
    }

    /// `list_links` (the raw dump, without counters) reports each device
    /// as netlink-packet-route's full parse of `link_by_index` does.
    #[test]
    fn list_links_matches_the_full_parse() {
        in_netns("list_links_matches_the_full_parse", |nl| async move {
            let a = add_bridge(&nl, "tb-a", 0).await;
            add_bridge(&nl, "tb-b", 7).await;
            nl.set_link(
                a,
                LinkChange {
                    mtu: Some(1400),
                    up: Some(true),
                    alias: Some("cube test"),
                    ..Default::default()
                },
            )
            .await
            .expect("set");
            let listed = nl.list_links().await.expect("list");
            let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
            assert_eq!(names, ["lo", "tb-a", "tb-b"]);
            for l in &listed {
                let mut full = nl
                    .link_by_index(l.index)
                    .await
                    .expect("get")
                    .expect("exists");
                full.counters = LinkCounters::default();
                assert_eq!(l, &full);
            }
            let tb_a = &listed[1];
            assert_eq!(
                (
                    tb_a.mtu,
                    tb_a.up,
                    tb_a.alias.as_deref(),
                    tb_a.kind.as_deref()
                ),
                (1400, true, Some("cube test"), Some("bridge"))
            );
            assert!(tb_a.mac.is_some());
            assert_eq!(listed[2].group, 7);
        });
    }

    #[test]
    fn delete_group_only_deletes_that_group() {
        in_netns("delete_group_only_deletes_that_group", |nl| async move {
            for i in 0..3 {
                add_bridge(&nl, &format!("g7-{i}"), 7).await;
            }
            for i in 0..2 {
                add_bridge(&nl, &format!("g8-{i}"), 8).await;
            }
            add_bridge(&nl, "g0", 0).await;
            nl.delete_group(7).await.expect("delete group 7");
            let mut names: Vec<String> = nl
                .list_links()
                .await
                .expect("list")
                .into_iter()
                .map(|l| l.name)
                .collect();
            names.sort();
            assert_eq!(names, ["g0", "g8-0", "g8-1", "lo"]);
            nl.delete_group(7).await.expect("empty group is Ok");
            assert!(matches!(
                nl.delete_group(0).await,
                Err(NetlinkError::GroupZero)
            ));
        });
    }

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
            // Only the IPv4 entries: an up link also gets IPv6 neighbours
            // of its own (ND, MLD) whenever the kernel sends on it.
            let v4 = |l: Vec<(IpAddr, Option<[u8; 6]>, u16)>| -> Vec<_> {
                l.into_iter().filter(|(i, _, _)| i.is_ipv4()).collect()
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

    /// Rough latency numbers; run with `cargo test -- --ignored --nocapture timings`.
    #[test]
    #[ignore]
    fn timings() {
        in_netns("timings", |nl| async move {
            let idx = add_bridge(&nl, "t0", 0).await;
            nl.set_link(idx, up(true)).await.expect("up");

            let n = 200u32;
            let t = Instant::now();
            for i in 0..n {
                let change = LinkChange {
                    mtu: Some(1400 + i % 2),
                    ..Default::default()
                };
                nl.set_link(idx, change).await.expect("set mtu");
            }
            eprintln!("set_link (mtu): {:?} avg over {n}", t.elapsed() / n);

            let t = Instant::now();
            for i in 0..n {
                nl.set_link(idx, up(i % 2 == 0)).await.expect("set up/down");
            }
            eprintln!("set_link (up/down): {:?} avg over {n}", t.elapsed() / n);
            nl.set_link(idx, up(true)).await.expect("up");

            let t = Instant::now();
            for i in 0..n {
                let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 0)) + i);
                nl.neigh_replace_permanent(idx, ip.into(), [2, 0, 0, 0, 0, 1])
                    .await
                    .expect("neigh");
            }
            eprintln!(
                "neigh_replace_permanent (new): {:?} avg over {n}",
                t.elapsed() / n
            );
            let t = Instant::now();
            for i in 0..n {
                let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 0)) + i);
                nl.neigh_replace_permanent(idx, ip.into(), [2, 0, 0, 0, 0, 2])
                    .await
                    .expect("neigh");
            }
            eprintln!(
                "neigh_replace_permanent (replace): {:?} avg over {n}",
                t.elapsed() / n
            );

            let mut idxs = Vec::new();
            for i in 0..50 {
                idxs.push(add_bridge(&nl, &format!("s{i}"), 0).await);
            }
            let t = Instant::now();
            for i in idxs {
                nl.delete_link(i).await.expect("delete");
            }
            eprintln!("50 x delete_link: {:?}", t.elapsed());

            for i in 0..50 {
                add_bridge(&nl, &format!("g{i}"), 9).await;
            }
            let t = Instant::now();
            nl.delete_group(9).await.expect("delete group");
            eprintln!("delete_group of 50 links: {:?}", t.elapsed());
            assert_eq!(nl.list_links().await.expect("list").len(), 2);
        });
    }
}
