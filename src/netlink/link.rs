//! Links: listing and looking up devices, changing their attributes,
//! veth pairs, batch deletion by link group and the pool's gateway device.

use std::net::Ipv4Addr;

use futures::stream::TryStreamExt;
use rtnetlink::packet_route::link::{
    LinkAttribute, LinkFlags, LinkInfo as NlLinkInfo, LinkMessage,
};
use rtnetlink::{LinkBridge, LinkDummy, LinkMessageBuilder, LinkUnspec};
use tracing::debug;

use super::raw::link_dump;
use super::{Netlink, NetlinkError, errno_of, is_errno};

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
    pub(super) fn from_msg(msg: &LinkMessage) -> Self {
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
    pub(super) fn is_empty(&self) -> bool {
        self.name.is_none()
            && self.mtu.is_none()
            && self.up.is_none()
            && self.group.is_none()
            && self.alias.is_none()
    }
}

impl Netlink {
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
        link_got(res.map(|m| m.map(|m| LinkInfo::from_msg(&m))), || {
            name.to_string()
        })
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
        link_got(res.map(|m| m.map(|m| LinkInfo::from_msg(&m))), || {
            index.to_string()
        })
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
            .change(super::request::link_change_msg(index, change))
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

    /// Creates `name` as a dummy, falling back to a port-less bridge when the kernel
    /// has no dummy driver. EEXIST (lost a race) counts as success.
    pub(super) async fn create_gateway(&self, name: &str) -> Result<(), NetlinkError> {
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
}

/// The answer to a GET of one link: `None` if there is none (ENODEV).
pub(super) fn link_got(
    res: Result<Option<LinkInfo>, rtnetlink::Error>,
    what: impl FnOnce() -> String,
) -> Result<Option<LinkInfo>, NetlinkError> {
    match res {
        Ok(l) => Ok(l),
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
        Err(source) => Err(NetlinkError::LinkGet {
            what: what(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{add_bridge, add_veth, in_netns, up};
    use super::super::*;
    use std::time::Instant;

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
