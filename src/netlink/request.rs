//! Blocking NETLINK_ROUTE requests made by the calling thread itself.
//!
//! The hot path of EnsureNetwork and ReleaseNetwork does its kernel work in
//! one closure on tokio's blocking pool (see `agent::off_worker`): bringing a
//! TAP up, the gateway's neighbour entry, the datapath's maps. Sending those
//! requests through the `netlink` thread would add a hop to another thread
//! (and its run-queue wait) per request; here the blocking thread sends the
//! request and reads the kernel's answer on a socket of its own. The kernel
//! does the work and queues the acknowledgement inside `sendmsg`, so the
//! answer is already there when `recv` is called.
//!
//! Sockets are pooled (one per thread in use at once, never more than the
//! blocking threads that ever ran a request at the same time) and live in
//! the network namespace recorded when the pool was made, whichever thread
//! later asks for one.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use rtnetlink::packet_core::{
    NLM_F_ACK, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// A socket of the pool and the sequence number of its next request.
struct Conn {
    sock: Socket,
    seq: u32,
}

/// The pool of request sockets of one network namespace.
pub(crate) struct Requests {
    /// The namespace the sockets belong to (an fd of it), and its inode.
    ns: File,
    ns_ino: u64,
    free: Mutex<Vec<Conn>>,
}

const THREAD_NS: &str = "/proc/thread-self/ns/net";

impl Requests {
    /// A pool for the calling thread's network namespace.
    pub(crate) fn new() -> std::io::Result<Self> {
        let ns = File::open(THREAD_NS)?;
        let ns_ino = ns.metadata()?.ino();
        Ok(Self {
            ns,
            ns_ino,
            free: Mutex::new(Vec::new()),
        })
    }

    /// Sends `msg` with `flags` (NLM_F_REQUEST and NLM_F_ACK added) and
    /// waits for the kernel's acknowledgement. Blocking.
    pub(crate) fn ack(&self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), rtnetlink::Error> {
        self.call(msg, flags | NLM_F_ACK, |_| None::<()>)
            .map(|_| ())
    }

    /// Sends `msg` (a GET of one object) and hands the reply to `pick`.
    /// `None` if the kernel answered with no object that `pick` took.
    pub(crate) fn get<T>(
        &self,
        msg: RouteNetlinkMessage,
        pick: impl FnMut(RouteNetlinkMessage) -> Option<T>,
    ) -> Result<Option<T>, rtnetlink::Error> {
        self.call(msg, 0, pick)
    }

    fn call<T>(
        &self,
        msg: RouteNetlinkMessage,
        flags: u16,
        mut pick: impl FnMut(RouteNetlinkMessage) -> Option<T>,
    ) -> Result<Option<T>, rtnetlink::Error> {
        let mut conn = self.take().map_err(io_failed)?;
        conn.seq = conn.seq.wrapping_add(1);
        let seq = conn.seq;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        req.finalize();
        let mut buf = vec![0; req.buffer_len()];
        req.serialize(&mut buf);
        let result = exchange(&mut conn.sock, &buf, seq, &mut pick);
        match &result {
            // A socket whose exchange broke off may still hold an answer:
            // closed, not reused.
            Err(rtnetlink::Error::RequestFailed) => {}
            _ => self.put(conn),
        }
        result
    }

    fn take(&self) -> std::io::Result<Conn> {
        if let Some(c) = self.lock().pop() {
            return Ok(c);
        }
        let sock = self.open()?;
        Ok(Conn { sock, seq: 0 })
    }

    fn put(&self, conn: Conn) {
        self.lock().push(conn);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new socket in the pool's namespace: made here when this thread is
    /// in it (always, in the agent), else by a short-lived thread that
    /// enters it first (tests that made the pool in a namespace of their
    /// own).
    fn open(&self) -> std::io::Result<Socket> {
        let here = std::fs::metadata(THREAD_NS)?.ino();
        if here == self.ns_ino {
            return connect();
        }
        let ns = self.ns.try_clone()?;
        std::thread::scope(|s| {
            s.spawn(move || {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)?;
                connect()
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("netlink socket thread panicked")))
        })
    }
}

fn connect() -> std::io::Result<Socket> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    Ok(sock)
}

/// A failure of the socket itself (not an answer of the kernel).
fn io_failed(e: std::io::Error) -> rtnetlink::Error {
    tracing::debug!(error = %e, "netlink request socket failed");
    rtnetlink::Error::RequestFailed
}

/// Sends one request and reads until its answer: the acknowledgement or
/// error (`NLMSG_ERROR`), or for a GET the object, which comes alone.
fn exchange<T>(
    sock: &mut Socket,
    req: &[u8],
    seq: u32,
    pick: &mut impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Option<T>, rtnetlink::Error> {
    sock.send(req, 0).map_err(io_failed)?;
    loop {
        let (data, _) = sock.recv_from_full().map_err(io_failed)?;
        let mut at = 0;
        while at + 16 <= data.len() {
            let len = u32::from_ne_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len < 16 || at + len > data.len() {
                return Err(rtnetlink::Error::RequestFailed);
            }
            let raw = &data[at..at + len];
            at += (len + 3) & !3;
            let their_seq = u32::from_ne_bytes(raw[8..12].try_into().expect("4 bytes"));
            if their_seq != seq {
                continue;
            }
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(raw)
                .map_err(|e| rtnetlink::Error::InvalidNla(e.to_string()))?;
            match msg.payload {
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    return Err(rtnetlink::Error::NetlinkError(e));
                }
                NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => return Ok(None),
                NetlinkPayload::InnerMessage(m) => {
                    // A GET without NLM_F_DUMP answers with the object and
                    // no acknowledgement.
                    return Ok(pick(m));
                }
                _ => {}
            }
        }
    }
}

use std::net::IpAddr;

use rtnetlink::LinkUnspec;
use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_REPLACE};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::link::LinkMessage;
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::RouteType;

use super::{LinkChange, LinkInfo, Netlink, NetlinkError, is_errno};

/// The RTM_NEWLINK (set) of a [`LinkChange`].
pub(super) fn link_change_msg(index: u32, change: LinkChange) -> LinkMessage {
    let mut b = LinkUnspec::new_with_index(index);
    if let Some(name) = change.name {
        b = b.name(name);
    }
    if let Some(mtu) = change.mtu {
        b = b.mtu(mtu);
    }
    if let Some(group) = change.group {
        b = b.link_group(group);
    }
    if let Some(alias) = change.alias {
        b = b.alias(alias);
    }
    b = match change.up {
        Some(true) => b.up(),
        Some(false) => b.down(),
        None => b,
    };
    b.build()
}

/// The neighbour message naming `ip` on `ifindex`.
pub(super) fn neigh_msg(ifindex: u32, ip: IpAddr) -> NeighbourMessage {
    let mut msg = NeighbourMessage::default();
    msg.header.ifindex = ifindex;
    let (family, addr) = match ip {
        IpAddr::V4(v4) => (AddressFamily::Inet, NeighbourAddress::Inet(v4)),
        IpAddr::V6(v6) => (AddressFamily::Inet6, NeighbourAddress::Inet6(v6)),
    };
    msg.header.family = family;
    msg.attributes.push(NeighbourAttribute::Destination(addr));
    msg
}

/// The answer to a neighbour deletion: `Ok(false)` if there was none
/// (ENOENT) or the link is gone (ENODEV).
pub(super) fn neigh_deleted(
    answer: Result<(), rtnetlink::Error>,
    ifindex: u32,
    ip: IpAddr,
) -> Result<bool, NetlinkError> {
    match answer {
        Ok(()) => Ok(true),
        Err(e) if is_errno(&e, libc::ENOENT) || is_errno(&e, libc::ENODEV) => Ok(false),
        Err(source) => Err(NetlinkError::NeighDel {
            ifindex,
            ip,
            source,
        }),
    }
}

/// Blocking versions of the requests on the hot path, sent by the calling
/// thread (module documentation). Call them off the async workers.
impl Netlink {
    /// [`Netlink::set_link`], blocking.
    pub fn set_link_now(&self, index: u32, change: LinkChange) -> Result<(), NetlinkError> {
        tracing::debug!(index, ?change, "set link");
        if change.is_empty() {
            return Ok(());
        }
        let msg = RouteNetlinkMessage::SetLink(link_change_msg(index, change));
        self.requests
            .ack(msg, 0)
            .map_err(|source| NetlinkError::LinkSet { index, source })
    }

    /// [`Netlink::neigh_replace_permanent`], blocking.
    pub fn neigh_replace_permanent_now(
        &self,
        ifindex: u32,
        ip: IpAddr,
        mac: [u8; 6],
    ) -> Result<(), NetlinkError> {
        tracing::debug!(ifindex, %ip, ?mac, "replace permanent neighbour");
        let mut msg = neigh_msg(ifindex, ip);
        msg.header.state = NeighbourState::Permanent;
        msg.header.kind = RouteType::Unspec;
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        self.requests
            .ack(
                RouteNetlinkMessage::NewNeighbour(msg),
                NLM_F_CREATE | NLM_F_REPLACE,
            )
            .map_err(|source| NetlinkError::NeighAdd {
                ifindex,
                ip,
                source,
            })
    }

    /// [`Netlink::neigh_del`], blocking: `Ok(false)` if there was none.
    pub fn neigh_del_now(&self, ifindex: u32, ip: IpAddr) -> Result<bool, NetlinkError> {
        tracing::debug!(ifindex, %ip, "delete neighbour");
        let msg = RouteNetlinkMessage::DelNeighbour(neigh_msg(ifindex, ip));
        neigh_deleted(self.requests.ack(msg, 0), ifindex, ip)
    }

    /// [`Netlink::link_by_index`], blocking.
    pub fn link_by_index_now(&self, index: u32) -> Result<Option<LinkInfo>, NetlinkError> {
        tracing::debug!(index, "get link by index");
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        let got = self
            .requests
            .get(RouteNetlinkMessage::GetLink(msg), |m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(LinkInfo::from_msg(&l)),
                _ => None,
            });
        super::link::link_got(got, || index.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::super::tests::{add_bridge, in_netns};
    use super::*;

    /// The blocking requests act on the pool's namespace even when the
    /// calling thread is in another one, and carry the kernel's errno.
    #[test]
    fn blocking_requests_act_in_the_pools_namespace() {
        in_netns(
            "blocking_requests_act_in_the_pools_namespace",
            |nl| async move {
                let index = add_bridge(&nl, "rq0", 0).await;
                let other = nl.clone();
                std::thread::spawn(move || {
                    // SAFETY: unshare() only takes an integer flag set and
                    // affects just this thread.
                    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
                    assert_eq!(rc, 0, "unshare: {}", std::io::Error::last_os_error());
                    let change = LinkChange {
                        mtu: Some(1400),
                        up: Some(true),
                        alias: Some("cube-test"),
                        ..Default::default()
                    };
                    other.set_link_now(index, change).expect("set link");
                    let l = other
                        .link_by_index_now(index)
                        .expect("get")
                        .expect("exists");
                    assert_eq!((l.name.as_str(), l.mtu, l.up), ("rq0", 1400, true));
                    assert_eq!(l.alias.as_deref(), Some("cube-test"));
                    let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9));
                    let mac = [0x20, 0x90, 0x6f, 1, 2, 3];
                    other
                        .neigh_replace_permanent_now(index, ip, mac)
                        .expect("neighbour");
                    other
                        .neigh_replace_permanent_now(index, ip, mac)
                        .expect("replaced");
                    assert!(other.neigh_del_now(index, ip).expect("deleted"));
                    assert!(!other.neigh_del_now(index, ip).expect("none left"));
                    assert!(other.link_by_index_now(999_999).expect("get").is_none());
                    let e = other
                        .set_link_now(
                            999_999,
                            LinkChange {
                                up: Some(true),
                                ..Default::default()
                            },
                        )
                        .expect_err("no such link");
                    assert_eq!(e.errno(), Some(libc::ENODEV), "{e}");
                })
                .join()
                .expect("request thread");
                // Seen from the pool's namespace, where the bridge lives.
                let l = nl.link_by_name("rq0").await.expect("get").expect("exists");
                assert_eq!((l.mtu, l.up), (1400, true));
                let neigh = nl.neigh_list(index).await.expect("neighbours");
                assert!(neigh.is_empty(), "{neigh:?}");
            },
        );
    }
}
