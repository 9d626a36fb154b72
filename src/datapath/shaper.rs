//! Bandwidth shapers over rtnetlink (docs/datapath.md "Bandwidth"): an
//! HTB qdisc `c0be:` at the root of a device, and per limited sandbox a
//! class tree under it: a parent at the limit, and two leaves that borrow
//! up to it, "small" (prio 0: pings, pure ACKs, DNS; served first) and
//! "bulk" (prio 1), each with a byte FIFO. The datapath picks the leaf by
//! setting `skb->priority` to its class id; on a sandbox's own device a
//! packet with any other priority goes to its bulk leaf (HTB's default
//! class: nothing reaches a limited sandbox unshaped), on the shared
//! shaper device to HTB's direct queue, unshaped and first. The
//! kernel this runs on may lack `fq` (no EDT pacing): HTB is everywhere.

use std::collections::HashMap;
use std::io;

use rtnetlink::packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_ECHO, NLM_F_REPLACE,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{TcAttribute, TcStats2};

use super::maps::SHAPER_HANDLE;
use super::tc::{Conn, tc_message};

const TC_H_ROOT: u32 = 0xFFFF_FFFF;
const TCA_OPTIONS: u16 = 2;
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_INIT: u16 = 2;
const TCA_HTB_DIRECT_QLEN: u16 = 5;
const TCA_HTB_RATE64: u16 = 6;
const TCA_HTB_CEIL64: u16 = 7;
const TC_HTB_PROTOVER: u32 = 3;
const TC_LINKLAYER_ETHERNET: u8 = 1;
/// Unshaped packets queued at most (HTB's direct queue).
const DIRECT_QLEN: u32 = 1000;
/// HTB's round-robin quantum between classes of one priority.
const QUANTUM: u32 = 100_000;
/// The small leaf's FIFO, bytes.
const SMALL_QUEUE: u32 = 32 * 1024;
/// The bulk leaf's FIFO holds at least this many bytes (three full-size
/// GSO packets), else 25 ms at the limit.
const BULK_QUEUE_MIN: u64 = 192 * 1024;
const BULK_QUEUE_NS: u64 = 25_000_000;

/// One sandbox's class ids on a device: (parent, small, bulk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tree {
    pub parent: u32,
    pub small: u32,
    pub bulk: u32,
}

/// What a device's root qdisc is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Root {
    /// The agent's shaper.
    Ours,
    /// The kernel's default for the device (noqueue, pfifo_fast, mq, ...:
    /// handle 0), which the shaper may replace.
    Default(String),
    /// Someone's own qdisc (kind, handle): left alone.
    Foreign(String, u32),
}

fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut v = Vec::with_capacity((len + 3) & !3);
    v.extend_from_slice(&(len as u16).to_ne_bytes());
    v.extend_from_slice(&kind.to_ne_bytes());
    v.extend_from_slice(value);
    v.resize((len + 3) & !3, 0);
    v
}

/// What `ifindex`'s root qdisc is (one request answered with NLM_F_ECHO).
pub fn root(conn: &mut Conn, ifindex: u32) -> io::Result<Root> {
    let m = tc_message(ifindex as i32, 0, TC_H_ROOT, 0);
    let replies = match conn.request(
        RouteNetlinkMessage::GetQueueDiscipline(m),
        NLM_F_ACK | NLM_F_ECHO,
    ) {
        Ok(r) => r,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            return Ok(Root::Default("noqueue".into()));
        }
        Err(e) => return Err(e),
    };
    for r in replies {
        if let RouteNetlinkMessage::NewQueueDiscipline(q) = r {
            let kind = q
                .attributes
                .iter()
                .find_map(|a| match a {
                    TcAttribute::Kind(k) => Some(k.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            let handle = u32::from(q.header.handle);
            return Ok(if kind == "htb" && handle == SHAPER_HANDLE {
                Root::Ours
            } else if handle & 0xFFFF_0000 == 0 {
                Root::Default(kind)
            } else {
                Root::Foreign(kind, handle)
            });
        }
    }
    Ok(Root::Default("noqueue".into()))
}

/// Makes the shaper `ifindex`'s root qdisc unless it is there already. A
/// qdisc of someone else's is an error that names it (nothing changed).
/// `default`: the minor of the class a packet without a class's priority
/// goes to (a sandbox's own device: its bulk leaf, so every packet
/// delivered to a limited sandbox is shaped — fragments after the first,
/// ICMP errors, whatever a path did not classify); 0: HTB's direct queue
/// (the shaper device, where the datapath classifies every packet).
pub fn ensure_root(conn: &mut Conn, ifindex: u32, device: &str, default: u32) -> io::Result<()> {
    match root(conn, ifindex)? {
        Root::Ours => Ok(()),
        Root::Default(_) => {
            let mut m = tc_message(ifindex as i32, SHAPER_HANDLE, TC_H_ROOT, 0);
            m.attributes.push(TcAttribute::Kind("htb".into()));
            let mut glob = Vec::with_capacity(20);
            for v in [TC_HTB_PROTOVER, 10, default, 0, 0] {
                glob.extend_from_slice(&v.to_ne_bytes());
            }
            let mut opts = nla(TCA_HTB_INIT, &glob);
            opts.extend(nla(TCA_HTB_DIRECT_QLEN, &DIRECT_QLEN.to_ne_bytes()));
            m.attributes
                .push(TcAttribute::Other(DefaultNla::new(TCA_OPTIONS, opts)));
            conn.request(
                RouteNetlinkMessage::NewQueueDiscipline(m),
                NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
            )
            .map(|_| ())
        }
        Root::Foreign(kind, handle) => Err(io::Error::other(format!(
            "{device} has a root qdisc of its own ({kind} {:x}:): bandwidth limits need the \
             agent's shaper there; nothing was changed",
            handle >> 16
        ))),
    }
}

/// Removes the shaper from `ifindex` (the kernel's default qdisc comes
/// back); a device without it is not an error.
pub fn remove_root(conn: &mut Conn, ifindex: u32) -> io::Result<()> {
    if root(conn, ifindex)? != Root::Ours {
        return Ok(());
    }
    let mut m = tc_message(ifindex as i32, SHAPER_HANDLE, TC_H_ROOT, 0);
    m.attributes.push(TcAttribute::Kind("htb".into()));
    match conn.request(RouteNetlinkMessage::DelQueueDiscipline(m), NLM_F_ACK) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// `struct tc_ratespec` for `bytes_per_s` (capped at u32: TCA_HTB_*64
/// carries more).
fn ratespec(bytes_per_s: u64) -> [u8; 12] {
    let mut r = [0u8; 12];
    r[1] = TC_LINKLAYER_ETHERNET;
    r[8..12].copy_from_slice(&(bytes_per_s.min(u64::from(u32::MAX)) as u32).to_ne_bytes());
    r
}

/// HTB's buffer for `burst` bytes at `bytes_per_s`: psched ticks (64 ns).
fn ticks(burst: u64, bytes_per_s: u64) -> u32 {
    let ns = u128::from(burst) * 1_000_000_000 / u128::from(bytes_per_s.max(1));
    (ns >> 6).min(u128::from(u32::MAX)) as u32
}

fn class(
    conn: &mut Conn,
    ifindex: u32,
    classid: u32,
    parent: u32,
    (rate, ceil): (u64, u64),
    burst: u64,
    prio: u32,
) -> io::Result<()> {
    let mut opt = Vec::with_capacity(44);
    opt.extend_from_slice(&ratespec(rate));
    opt.extend_from_slice(&ratespec(ceil));
    for v in [ticks(burst, rate), ticks(burst, ceil), QUANTUM, 0, prio] {
        opt.extend_from_slice(&v.to_ne_bytes());
    }
    let mut opts = nla(TCA_HTB_PARMS, &opt);
    if rate > u64::from(u32::MAX) {
        opts.extend(nla(TCA_HTB_RATE64, &rate.to_ne_bytes()));
    }
    if ceil > u64::from(u32::MAX) {
        opts.extend(nla(TCA_HTB_CEIL64, &ceil.to_ne_bytes()));
    }
    let mut m = tc_message(ifindex as i32, classid, parent, 0);
    m.attributes.push(TcAttribute::Kind("htb".into()));
    m.attributes
        .push(TcAttribute::Other(DefaultNla::new(TCA_OPTIONS, opts)));
    conn.request(
        RouteNetlinkMessage::NewTrafficClass(m),
        NLM_F_ACK | NLM_F_CREATE,
    )
    .map(|_| ())
}

/// A byte FIFO of `limit` bytes as the leaf qdisc of `classid`: replaces
/// the class's default qdisc (the kernel picks the handle, so it never
/// meets another qdisc's), or changes the limit of the FIFO already there.
fn leaf(conn: &mut Conn, ifindex: u32, classid: u32, limit: u32) -> io::Result<()> {
    let mut m = tc_message(ifindex as i32, 0, classid, 0);
    m.attributes.push(TcAttribute::Kind("bfifo".into()));
    m.attributes.push(TcAttribute::Other(DefaultNla::new(
        TCA_OPTIONS,
        limit.to_ne_bytes().to_vec(),
    )));
    conn.request(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
    )
    .map(|_| ())
}

/// Creates or changes a sandbox's tree for `bps` bits/s and `burst`
/// bytes: the parent holds the limit, the leaves borrow up to it (small
/// is guaranteed a tenth, at least 8 kbit/s). Changing a running tree
/// keeps its queues.
pub fn set_tree(conn: &mut Conn, ifindex: u32, t: Tree, bps: u64, burst: u64) -> io::Result<()> {
    let limit = (bps / 8).max(1);
    let small = (limit / 10).clamp(1000, limit);
    let bulk = limit.saturating_sub(small).max(1000).min(limit);
    class(
        conn,
        ifindex,
        t.parent,
        SHAPER_HANDLE,
        (limit, limit),
        burst,
        0,
    )?;
    class(conn, ifindex, t.small, t.parent, (small, limit), burst, 0)?;
    class(conn, ifindex, t.bulk, t.parent, (bulk, limit), burst, 1)?;
    let queue = (u128::from(limit) * u128::from(BULK_QUEUE_NS) / 1_000_000_000) as u64;
    leaf(conn, ifindex, t.small, SMALL_QUEUE)?;
    leaf(
        conn,
        ifindex,
        t.bulk,
        queue.clamp(BULK_QUEUE_MIN, u64::from(u32::MAX)) as u32,
    )
}

/// Deletes a sandbox's tree (leaves first); classes already gone are not
/// an error.
pub fn remove_tree(conn: &mut Conn, ifindex: u32, t: Tree) -> io::Result<()> {
    for (id, parent) in [
        (t.small, t.parent),
        (t.bulk, t.parent),
        (t.parent, SHAPER_HANDLE),
    ] {
        let m = tc_message(ifindex as i32, id, parent, 0);
        match conn.request(RouteNetlinkMessage::DelTrafficClass(m), NLM_F_ACK) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {}
            other => other.map(|_| ())?,
        }
    }
    Ok(())
}

/// One class's statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassStats {
    pub bytes: u64,
    pub packets: u64,
    pub drops: u64,
    pub overlimits: u64,
}

/// Every class of `ifindex` with its statistics (one dump).
pub fn class_stats(conn: &mut Conn, ifindex: u32) -> io::Result<HashMap<u32, ClassStats>> {
    let m = tc_message(ifindex as i32, 0, 0, 0);
    let replies = match conn.request(RouteNetlinkMessage::GetTrafficClass(m), NLM_F_DUMP) {
        Ok(r) => r,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENODEV | libc::EINVAL)) => vec![],
        Err(e) => return Err(e),
    };
    Ok(parse_stats(replies))
}

/// The statistics of one class of `ifindex` (one request, answered with
/// NLM_F_ECHO); None if it does not exist.
pub fn one_class(conn: &mut Conn, ifindex: u32, classid: u32) -> io::Result<Option<ClassStats>> {
    let m = tc_message(ifindex as i32, classid, classid & 0xFFFF_0000, 0);
    match conn.request(
        RouteNetlinkMessage::GetTrafficClass(m),
        NLM_F_ACK | NLM_F_ECHO,
    ) {
        Ok(r) => Ok(parse_stats(r).remove(&classid)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::EINVAL | libc::ENODEV)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn parse_stats(replies: Vec<RouteNetlinkMessage>) -> HashMap<u32, ClassStats> {
    let mut out = HashMap::new();
    for r in replies {
        let RouteNetlinkMessage::NewTrafficClass(c) = r else {
            continue;
        };
        let mut s = ClassStats::default();
        for a in &c.attributes {
            if let TcAttribute::Stats2(stats) = a {
                for st in stats {
                    match st {
                        TcStats2::Basic(b) => {
                            s.bytes = b.bytes;
                            s.packets = u64::from(b.packets);
                        }
                        TcStats2::Queue(q) => {
                            s.drops = u64::from(q.drops);
                            s.overlimits = u64::from(q.overlimits);
                        }
                        _ => {}
                    }
                }
            }
        }
        out.insert(u32::from(c.header.handle), s);
    }
    out
}

impl ClassStats {
    /// The sum of two classes' statistics (a tree's two leaves).
    pub fn plus(self, o: ClassStats) -> ClassStats {
        ClassStats {
            bytes: self.bytes + o.bytes,
            packets: self.packets + o.packets,
            drops: self.drops + o.drops,
            overlimits: self.overlimits + o.overlimits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings() {
        assert_eq!(nla(5, &[1, 2, 3, 4]).len(), 8);
        assert_eq!(nla(5, &[1]).len(), 8);
        // 64 KiB at 40 Mbit/s: 13.1 ms, in 64 ns ticks.
        assert_eq!(ticks(65_536, 5_000_000), 204_800);
        let r = ratespec(5_000_000);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 5_000_000);
        let r = ratespec(1 << 40);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), u32::MAX);
    }
}
