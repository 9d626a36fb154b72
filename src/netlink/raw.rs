//! Raw dumps: one request on a fresh NETLINK_ROUTE socket, parsed by
//! hand for the fields needed (`link_dump`, `link_counters_dump`), and
//! the byte/attribute helpers they use.

use super::link::{LinkCounters, LinkInfo};

/// Sends one dump request (`kind`, then `body` after the nlmsghdr) on a
/// fresh NETLINK_ROUTE socket and hands each reply message (its type and
/// bytes, header included) to `each`, until NLMSG_DONE. For dumps a full
/// parse into netlink-packet-route's types made slow at 10,000 devices.
/// Blocking: call it off the async workers.
pub(super) fn raw_dump(
    kind: u16,
    body: &[u8],
    mut each: impl FnMut(u16, &[u8]),
) -> std::io::Result<()> {
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
    loop {
        let (data, _) = sock.recv_from_full()?;
        for msg in messages(&data) {
            let (kind, msg) = msg?;
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = if msg.len() >= 20 {
                        u32_at(msg, 16) as i32
                    } else {
                        0
                    };
                    if code != 0 {
                        return Err(std::io::Error::from_raw_os_error(-code));
                    }
                }
                _ if u32_at(msg, 8) == SEQ => each(kind, msg),
                _ => {}
            }
        }
    }
}

/// The netlink messages of one datagram: (type, bytes with the header).
/// A truncated message ends the walk with an error.
pub(super) fn messages(data: &[u8]) -> impl Iterator<Item = std::io::Result<(u16, &[u8])>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at + 16 > data.len() {
            return None;
        }
        let len = u32_at(data, at) as usize;
        let kind = u16_at(data, at + 4);
        if len < 16 || at + len > data.len() {
            at = data.len();
            return Some(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "truncated netlink message",
            )));
        }
        let msg = &data[at..at + len];
        at += (len + 3) & !3;
        Some(Ok((kind, msg)))
    })
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The attributes of a netlink message from byte `from` on, as (type
/// without the nested/byte-order flags, payload).
pub(super) fn attrs(msg: &[u8], from: usize) -> impl Iterator<Item = (u16, &[u8])> {
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
pub(super) fn nl_str(payload: &[u8]) -> String {
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
    const RTM_GETLINK: u16 = 18;
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
        out.extend(link_of(kind, msg));
    })?;
    Ok(out)
}

/// An `RTM_NEWLINK` message (a dump's, or an announcement's) parsed for
/// the fields [`LinkInfo`] has, without its counters (they stay zero).
/// `None` for any other message.
pub(super) fn link_of(kind: u16, msg: &[u8]) -> Option<LinkInfo> {
    const RTM_NEWLINK: u16 = 16;
    // linux/if_link.h
    const IFLA_ADDRESS: u16 = 1;
    const IFLA_IFNAME: u16 = 3;
    const IFLA_MTU: u16 = 4;
    const IFLA_LINKINFO: u16 = 18;
    const IFLA_INFO_KIND: u16 = 1;
    const IFLA_IFALIAS: u16 = 20;
    const IFLA_GROUP: u16 = 27;
    if kind != RTM_NEWLINK || msg.len() < 32 {
        return None;
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
    Some(info)
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
