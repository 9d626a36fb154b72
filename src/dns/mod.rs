//! The resolver for sandboxes (docs/egress.md), a wire edge: DNS over UDP
//! and TCP on the gateway device's address, port 53 (what a guest reaches
//! at its gateway). It parses the question, asks the core
//! ([`EgressPolicy::dns_decide`]), answers REFUSED or NODATA itself (NODATA for
//! every AAAA question of a sandbox whose IPv6 does not reach the world), or forwards
//! the query to the upstream resolver and, for a sandbox with domain
//! rules, has the answer's addresses learned ([`EgressPolicy::dns_learn`])
//! before the answer is sent on.

pub mod intercept;
pub mod proxy;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tracing::{debug, info, warn};

use crate::policy::{DnsDecision, EgressPolicy};

/// How long the upstream has to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// UDP queries forwarded at once from one source address at most (in
/// all: `policy::MAX_IN_FLIGHT`, each on a socket of its own, waiting for
/// the upstream up to [`UPSTREAM_TIMEOUT`]; see [`Shares`]: fewer when
/// many sources hold slots). A query that finds no slot gets SERVFAIL at
/// once: the receive loop never waits.
const MAX_UDP_PER_SOURCE: usize = 32;
/// DNS over TCP: connections at once per source address (in all:
/// `policy::MAX_TCP`, each with one to the upstream while a query is
/// forwarded), and how long one may sit idle. A connection beyond its
/// share is closed at once.
const MAX_TCP_PER_SOURCE: usize = 8;
const TCP_IDLE: Duration = Duration::from_secs(5);
/// The largest DNS message (and the buffer an upstream's UDP answer is
/// read into: a larger one than the client can take gets TC, not cut).
const MAX_MESSAGE: usize = 65535;
/// A UDP answer's size without EDNS (RFC 1035).
const CLASSIC_UDP: usize = 512;
/// IPv4 and UDP headers: what a datagram of a sandbox's MTU leaves for
/// the DNS message.
const IPV4_UDP_HEADERS: u32 = 28;
const TYPE_OPT: u16 = 41;

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
const TYPE_CNAME: u16 = 5;
const TYPE_SVCB: u16 = 64;
const TYPE_HTTPS: u16 = 65;
const CLASS_IN: u16 = 1;
const RCODE_SERVFAIL: u8 = 2;
const RCODE_REFUSED: u8 = 5;

/// The question of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    /// Lowercase, without the trailing dot.
    pub name: String,
    pub qtype: u16,
    /// Where the question section ends (header + question).
    pub end: usize,
}

fn u16_at(m: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*m.get(at)?, *m.get(at + 1)?]))
}

fn u32_at(m: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(m.get(at..at + 4)?.try_into().ok()?))
}

/// Reads a (possibly compressed) name at `at`: (lowercase name, where
/// the name ends in the message).
fn read_name(m: &[u8], mut at: usize) -> Option<(String, usize)> {
    let mut name = String::new();
    let mut end = None;
    // A compression pointer must point backwards; bounded anyway.
    for _ in 0..128 {
        let len = *m.get(at)? as usize;
        match len {
            0 => return Some((name, end.unwrap_or(at + 1))),
            l if l & 0xc0 == 0xc0 => {
                let target = (u16_at(m, at)? & 0x3fff) as usize;
                if target >= at {
                    return None;
                }
                end.get_or_insert(at + 2);
                at = target;
            }
            l if l < 64 => {
                let label = m.get(at + 1..at + 1 + l)?;
                if !name.is_empty() {
                    name.push('.');
                }
                name.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
                if name.len() > 253 {
                    return None;
                }
                at += 1 + l;
            }
            _ => return None,
        }
    }
    None
}

/// Parses a query: one question, QR clear, opcode QUERY.
pub fn parse_query(m: &[u8]) -> Option<Question> {
    let flags = u16_at(m, 2)?;
    if flags & 0x8000 != 0 || (flags >> 11) & 0xf != 0 || u16_at(m, 4)? != 1 {
        return None;
    }
    let (name, at) = read_name(m, 12)?;
    let qtype = u16_at(m, at)?;
    u16_at(m, at + 2)?;
    Some(Question {
        id: u16_at(m, 0)?,
        name,
        qtype,
        end: at + 4,
    })
}

/// A query for `name` (type `qtype`, class IN, recursion desired): what
/// a stub resolver sends; for clients and tests.
pub fn encode_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = id.to_be_bytes().to_vec();
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for l in name.split('.').filter(|l| !l.is_empty()) {
        m.push(l.len() as u8);
        m.extend_from_slice(l.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&CLASS_IN.to_be_bytes());
    m
}

/// An answer of our own to `query`: its question, no records, `rcode`
/// (0 with no records: NODATA).
pub fn reply(query: &[u8], q: &Question, rcode: u8) -> Vec<u8> {
    let mut r = Vec::with_capacity(q.end);
    r.extend_from_slice(&q.id.to_be_bytes());
    // QR, the query's RD, RA, rcode.
    let rd = query[2] & 0x01;
    r.push(0x80 | rd);
    r.push(0x80 | (rcode & 0x0f));
    r.extend_from_slice(&1u16.to_be_bytes());
    r.extend_from_slice(&[0; 6]);
    r.extend_from_slice(&query[12..q.end]);
    r
}

/// The addresses an answer gives for `name`, with their TTLs: A and AAAA
/// records of the name or of a name it is a CNAME of within this answer
/// (in order), nothing from the authority or additional sections.
pub fn answer_addrs(m: &[u8], name: &str) -> Option<Vec<(IpAddr, u32)>> {
    let qd = u16_at(m, 4)?;
    let an = u16_at(m, 6)?;
    let mut at = 12;
    for _ in 0..qd {
        at = read_name(m, at)?.1 + 4;
    }
    let mut chain = vec![name.to_owned()];
    let mut records = vec![];
    for _ in 0..an {
        let (owner, next) = read_name(m, at)?;
        let (rtype, class, ttl) = (u16_at(m, next)?, u16_at(m, next + 2)?, u32_at(m, next + 4)?);
        let len = u16_at(m, next + 8)? as usize;
        let data = next + 10;
        m.get(data..data + len)?;
        records.push((owner, rtype, class, ttl, data, len));
        at = data + len;
    }
    // CNAMEs first (their order in the answer is the chain's, but be
    // lenient), then the A records of any name on the chain.
    loop {
        let before = chain.len();
        for (owner, rtype, class, _, data, _) in &records {
            if *rtype == TYPE_CNAME && *class == CLASS_IN && chain.contains(owner) {
                let (target, _) = read_name(m, *data)?;
                if !chain.contains(&target) {
                    chain.push(target);
                }
            }
        }
        if chain.len() == before {
            break;
        }
    }
    Some(
        records
            .iter()
            .filter(|(owner, _, class, ..)| *class == CLASS_IN && chain.contains(owner))
            .filter_map(|(_, rtype, _, ttl, data, len)| {
                let rdata = &m[*data..data + len];
                let ip = match (*rtype, *len) {
                    (TYPE_A, 4) => IpAddr::from(<[u8; 4]>::try_from(rdata).ok()?),
                    (TYPE_AAAA, 16) => IpAddr::from(<[u8; 16]>::try_from(rdata).ok()?),
                    _ => return None,
                };
                Some((ip, *ttl))
            })
            .collect(),
    )
}

/// A random query id (getrandom(2)).
pub(crate) fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    if crate::random::getrandom(&mut b).is_err() {
        return 0x5a5a;
    }
    u16::from_ne_bytes(b)
}

/// Sockets handed back by the fd store, by name
/// (`systemd::SOCKET_FD_NAMES`).
pub type Passed = std::collections::HashMap<String, OwnedFd>;

/// The address a socket is bound to.
fn bound_address(fd: &OwnedFd) -> Option<SocketAddr> {
    use nix::sys::socket::{SockaddrLike, SockaddrStorage, getsockname};
    let a = getsockname::<SockaddrStorage>(fd.as_raw_fd()).ok()?;
    match a.family()? {
        nix::sys::socket::AddressFamily::Inet => {
            Some(SocketAddrV4::from(*a.as_sockaddr_in()?).into())
        }
        nix::sys::socket::AddressFamily::Inet6 => {
            Some(std::net::SocketAddrV6::from(*a.as_sockaddr_in6()?).into())
        }
        _ => None,
    }
}

/// The socket `name` bound to `at`: the one the fd store handed back if it
/// is that (same type, same address), else a new one, which goes into the
/// fd store, so that the next start finds it with what arrived meanwhile
/// (queries, connections) queued.
fn adopt_or_bind(
    passed: &mut Passed,
    name: &str,
    at: SocketAddr,
    udp: bool,
) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{SockType, getsockopt, sockopt};
    if let Some(fd) = passed.remove(name) {
        let want = if udp {
            SockType::Datagram
        } else {
            SockType::Stream
        };
        let same = getsockopt(&fd, sockopt::SockType).is_ok_and(|t| t == want)
            && bound_address(&fd) == Some(at);
        if same {
            info!(name, address = %at, "socket handed back by the fd store");
            return Ok(fd);
        }
        crate::systemd::remove_fd(name);
    }
    let fd: OwnedFd = if udp {
        std::net::UdpSocket::bind(at)?.into()
    } else {
        std::net::TcpListener::bind(at)?.into()
    };
    if let Err(e) = crate::systemd::store_fd(name, fd.as_fd()) {
        debug!(name, error = %e, "not kept in the fd store");
    }
    Ok(fd)
}

/// Where the agent's sockets for sandboxes listen: the gateway device's
/// IPv4 address, and its IPv6 one where the node reaches sandboxes over
/// IPv6 (`ipv6_pool` routed; docs/dual-stack.md), with the suffix the fd
/// store names that family's sockets with.
pub(crate) fn service_addresses(agent: &impl EgressPolicy) -> Vec<(IpAddr, &'static str)> {
    let mut at = vec![(IpAddr::V4(agent.resolver_address()), "")];
    if let Some(v6) = agent.resolver_address6() {
        at.push((IpAddr::V6(v6), "6"));
    }
    at
}

/// Binds the resolver and serves it on the runtime, on every address of
/// [`service_addresses`]. A failed bind is reported to the caller (the
/// agent runs on; sandboxes with domain rules then resolve nothing).
pub fn serve(
    agent: Arc<impl EgressPolicy>,
    upstream: Option<SocketAddrV4>,
    passed: &mut Passed,
) -> std::io::Result<()> {
    let caps = agent.socket_caps();
    // One budget per sandbox, whichever family it asks over.
    let shares = (
        Shares::new(caps.udp, MAX_UDP_PER_SOURCE),
        Shares::new(caps.tcp, MAX_TCP_PER_SOURCE),
    );
    let mut bound = Ok(());
    let mut listening = vec![];
    for (ip, suffix) in service_addresses(&*agent) {
        let at = SocketAddr::new(ip, 53);
        match bind(agent.clone(), upstream, at, suffix, passed, shares.clone()) {
            Ok(()) => listening.push(at.to_string()),
            Err(e) => {
                bound = Err(std::io::Error::new(e.kind(), format!("binding {at}: {e}")));
                break;
            }
        }
    }
    let at = listening.join(", ");
    agent.resolver_status(match &bound {
        Ok(()) => match upstream {
            Some(u) => Ok(format!("listening on {at} (UDP, TCP), upstream {u}")),
            None => Err(format!(
                "listening on {at}, but no upstream (dns_upstream, /etc/resolv.conf): allowed queries get SERVFAIL"
            )),
        },
        Err(e) => Err(e.to_string()),
    });
    if bound.is_ok() {
        match upstream {
            Some(u) => info!(address = %at, upstream = %u, "dns: resolver for sandboxes"),
            None => {
                warn!(address = %at, "dns: no upstream (dns_upstream, /etc/resolv.conf): allowed queries get SERVFAIL")
            }
        }
    }
    // Health's view of the upstream stays true without traffic: asked
    // when no sandbox asked anything for a while.
    if let Some(u) = upstream.filter(|_| bound.is_ok()) {
        let agent = agent.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if agent.upstream_probe_due() {
                    let r = probe(u).await;
                    agent.upstream_outcome(r.as_ref().map(|_| ()));
                }
            }
        });
    }
    bound
}

/// The resolver's UDP socket and TCP listener on `at` (fd store names
/// `dns-udp`/`dns-tcp` with `suffix`), served on the runtime.
fn bind(
    agent: Arc<impl EgressPolicy>,
    upstream: Option<SocketAddrV4>,
    at: SocketAddr,
    suffix: &str,
    passed: &mut Passed,
    (shares, tcp_shares): (Shares, Shares),
) -> std::io::Result<()> {
    let std_sock = std::net::UdpSocket::from(adopt_or_bind(
        passed,
        &format!("dns-udp{suffix}"),
        at,
        true,
    )?);
    std_sock.set_nonblocking(true)?;
    // Which device each query came in on: see `recv_query`.
    let pktinfo = match at {
        SocketAddr::V4(_) => nix::sys::socket::setsockopt(
            &std_sock,
            nix::sys::socket::sockopt::Ipv4PacketInfo,
            &true,
        ),
        SocketAddr::V6(_) => nix::sys::socket::setsockopt(
            &std_sock,
            nix::sys::socket::sockopt::Ipv6RecvPacketInfo,
            &true,
        ),
    };
    pktinfo.map_err(std::io::Error::from)?;
    let gateway_ifindex = agent.resolver_ifindex();
    let sock = Arc::new(UdpSocket::from_std(std_sock)?);
    let std_listener = std::net::TcpListener::from(adopt_or_bind(
        passed,
        &format!("dns-tcp{suffix}"),
        at,
        false,
    )?);
    std_listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(std_listener)?;
    tokio::spawn(serve_tcp(agent.clone(), upstream, listener, tcp_shares));
    tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let (n, from, ifindex) = match recv_query(&sock, &mut buf).await {
                Ok(r) => r,
                Err(e) => {
                    debug!(error = %e, "dns: receiving");
                    continue;
                }
            };
            // A sandbox's query arrives through the gateway device (the
            // datapath injects the guest's packet there). One from
            // anywhere else is nobody's, whatever its source address
            // says (a sandbox address forged on the uplink): judged as a
            // stranger's. (On the node, a source address no device has
            // takes IP_TRANSPARENT, CAP_NET_ADMIN.)
            let src = if ifindex == gateway_ifindex {
                agent.sandbox_source(from.ip())
            } else {
                Ipv4Addr::UNSPECIFIED
            };
            let query = &buf[..n];
            // Answered at once when nothing is to wait for (a burst queued
            // while the agent restarted is not cut by the caps below).
            let (q, upstream, learn_for) = match plan(&*agent, upstream, src, query) {
                Plan::Drop => continue,
                Plan::Reply(r) => {
                    send_now(&sock, &r, from).await;
                    continue;
                }
                Plan::Forward {
                    q,
                    upstream,
                    learn_for,
                } => (q, upstream, learn_for),
            };
            // No slot within the source's share: SERVFAIL at once (the
            // client may try again), never a wait here.
            let Some(held) = shares.try_take(src) else {
                agent.resolver_busy();
                send_now(&sock, &reply(query, &q, RCODE_SERVFAIL), from).await;
                continue;
            };
            // An IPv6 header is 20 bytes longer than IPv4's.
            let extra = if from.is_ipv6() { 20 } else { 0 };
            let limit = udp_limit(query, agent.dns_udp_mtu(src).saturating_sub(extra));
            let query = query.to_vec();
            let (agent, sock) = (agent.clone(), sock.clone());
            tokio::spawn(async move {
                let answer =
                    forward_and_learn(&*agent, src, &query, (q, upstream, learn_for), Some(limit))
                        .await;
                let _ = sock.send_to(&answer, from).await;
                drop(held);
            });
        }
    });
    Ok(())
}

/// Sends a datagram without waiting when the socket has room (it nearly
/// always has).
async fn send_now(sock: &UdpSocket, m: &[u8], to: SocketAddr) {
    if sock.try_send_to(m, to).is_err() {
        let _ = sock.send_to(m, to).await;
    }
}

/// The OPT record of a query or answer: (offset of its class field, the
/// UDP payload size it advertises).
fn edns_at(m: &[u8]) -> Option<(usize, u16)> {
    let counts: Vec<u16> = (0..4)
        .map(|i| u16_at(m, 4 + 2 * i))
        .collect::<Option<_>>()?;
    let mut at = 12;
    for _ in 0..counts[0] {
        at = read_name(m, at)?.1 + 4;
    }
    for i in 0..(u32::from(counts[1]) + u32::from(counts[2]) + u32::from(counts[3])) {
        let (_, next) = read_name(m, at)?;
        let rtype = u16_at(m, next)?;
        if rtype == TYPE_OPT && i >= u32::from(counts[1]) + u32::from(counts[2]) {
            return Some((next + 2, u16_at(m, next + 2)?));
        }
        at = next + 10 + usize::from(u16_at(m, next + 8)?);
    }
    None
}

/// The largest UDP answer a client can take: what its query advertises
/// (EDNS; 512 without), and never more than its link carries (a datagram
/// over the sandbox's MTU would be lost on the way into its TAP or veth,
/// and the client would wait for a timeout instead of retrying over TCP).
pub fn udp_limit(query: &[u8], mtu: u32) -> usize {
    let link = mtu.saturating_sub(IPV4_UDP_HEADERS) as usize;
    let asked = edns_at(query).map_or(CLASSIC_UDP, |(_, size)| usize::from(size));
    asked.max(CLASSIC_UDP).min(link.max(CLASSIC_UDP))
}

/// The query as sent upstream over UDP: its advertised size lowered to
/// `limit`, so the upstream truncates (TC) what the client could not take.
fn clamp_edns(query: &[u8], limit: usize) -> std::borrow::Cow<'_, [u8]> {
    match edns_at(query) {
        Some((at, size)) if usize::from(size) > limit => {
            let mut q = query.to_vec();
            q[at..at + 2].copy_from_slice(&(limit as u16).to_be_bytes());
            std::borrow::Cow::Owned(q)
        }
        _ => std::borrow::Cow::Borrowed(query),
    }
}

/// The answer cut to its header and question, with TC set: the client
/// asks again over TCP.
fn truncated(query: &[u8], q: &Question, resp: &[u8]) -> Vec<u8> {
    let mut r = reply(query, q, resp[3] & 0x0f);
    r[2] = resp[2] | 0x82;
    r[3] = resp[3];
    r
}

/// One datagram: its length, its source and the device it came in on
/// (IP_PKTINFO, IPV6_PKTINFO).
async fn recv_query(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, u32)> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg};
    loop {
        sock.readable().await?;
        let got = sock.try_io(tokio::io::Interest::READABLE, || {
            let mut iov = [std::io::IoSliceMut::new(buf)];
            let mut cmsg = nix::cmsg_space!(libc::in6_pktinfo);
            let m = recvmsg::<SockaddrStorage>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::empty(),
            )
            .map_err(std::io::Error::from)?;
            let ifindex = m
                .cmsgs()
                .map_err(std::io::Error::from)?
                .find_map(|c| match c {
                    ControlMessageOwned::Ipv4PacketInfo(i) => Some(i.ipi_ifindex as u32),
                    ControlMessageOwned::Ipv6PacketInfo(i) => Some(i.ipi6_ifindex),
                    _ => None,
                })
                .unwrap_or(0);
            let from = m
                .address
                .and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|a| SocketAddr::from(SocketAddrV4::from(*a)))
                        .or_else(|| {
                            a.as_sockaddr_in6()
                                .map(|a| SocketAddr::from(std::net::SocketAddrV6::from(*a)))
                        })
                })
                .ok_or_else(|| std::io::Error::other("no source address"))?;
            Ok((m.bytes, from, ifindex))
        });
        match got {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// DNS over TCP (RFC 7766): length-prefixed queries on a connection,
/// answered in order, forwarded over TCP (an answer too large for UDP).
async fn serve_tcp(
    agent: Arc<impl EgressPolicy>,
    upstream: Option<SocketAddrV4>,
    listener: TcpListener,
    shares: Shares,
) {
    loop {
        let (mut conn, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                debug!(error = %e, "dns: accepting");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let src = agent.sandbox_source(from.ip());
        // Strangers share one source's slots (each is refused anyway): no
        // number of local addresses dilutes the sandboxes' shares.
        let source = if agent.is_sandbox(src) {
            src
        } else {
            Ipv4Addr::UNSPECIFIED
        };
        let Some(held) = shares.try_take(source) else {
            // Closed at once: the client retries (or gives up) without
            // waiting for a timeout.
            agent.resolver_busy();
            continue;
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            let mut len = [0u8; 2];
            while let Ok(Ok(_)) = tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut len)).await {
                let mut query = vec![0u8; u16::from_be_bytes(len) as usize];
                if !matches!(
                    tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut query)).await,
                    Ok(Ok(_))
                ) {
                    break;
                }
                let Some(a) = answer(&*agent, upstream, src, &query).await else {
                    break;
                };
                let mut out = (a.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&a);
                if conn.write_all(&out).await.is_err() {
                    break;
                }
            }
            drop(held);
        });
    }
}

/// Slots shared by every sandbox (the resolver's queries in flight and
/// TCP connections, the proxy's connections): at most `total` at once,
/// each source at most `per_source`, and never more than its fair share:
/// `total / (sources wanting slots + 1)`, counting itself and every source
/// that holds slots or was refused one lately ([`DEMAND_WINDOW`]). A
/// source refused now is counted at once, so as the holders' work ends
/// (an upstream timeout at most) they take slots again only up to a share
/// that leaves it room: N sources flooding never keep the others out for
/// longer than that. Taking never waits: a caller that gets none answers
/// at once (SERVFAIL, a reset).
#[derive(Clone)]
pub(crate) struct Shares {
    inner: Arc<std::sync::Mutex<SharesInner>>,
    total: usize,
    per_source: usize,
}

/// How long a refused source still counts as wanting slots: longer than
/// the longest a slot is held for one query.
const DEMAND_WINDOW: Duration = Duration::from_secs(10);

#[derive(Default)]
struct SharesInner {
    by_source: std::collections::HashMap<Ipv4Addr, usize>,
    used: usize,
    /// Sources refused a slot lately (and when), that hold none now.
    wanting: std::collections::HashMap<Ipv4Addr, std::time::Instant>,
}

/// One slot of a source; given back on drop.
pub(crate) struct Held(Shares, Ipv4Addr);

impl Shares {
    pub(crate) fn new(total: usize, per_source: usize) -> Self {
        Shares {
            inner: Arc::default(),
            total,
            per_source,
        }
    }

    /// A slot for `src`, if there is one within its share.
    pub(crate) fn try_take(&self, src: Ipv4Addr) -> Option<Held> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if g.wanting.len() > self.total {
            g.wanting
                .retain(|_, at| now.duration_since(*at) < DEMAND_WINDOW);
        }
        let mine = g.by_source.get(&src).copied().unwrap_or(0);
        let wanting = g
            .wanting
            .iter()
            .filter(|(ip, at)| **ip != src && now.duration_since(**at) < DEMAND_WINDOW)
            .count();
        let others = g.by_source.len() - usize::from(mine > 0) + wanting;
        let share = (self.total / (others + 2)).clamp(1, self.per_source);
        if g.used >= self.total || mine >= share {
            if mine == 0 && g.wanting.len() < 4 * self.total {
                g.wanting.insert(src, now);
            }
            return None;
        }
        g.wanting.remove(&src);
        g.used += 1;
        *g.by_source.entry(src).or_default() += 1;
        Some(Held(self.clone(), src))
    }

    /// Slots in use.
    #[cfg(test)]
    fn used(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).used
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut g = (self.0).inner.lock().unwrap_or_else(|p| p.into_inner());
        g.used -= 1;
        if let Some(c) = g.by_source.get_mut(&self.1) {
            *c -= 1;
            if *c == 0 {
                g.by_source.remove(&self.1);
            }
        }
    }
}

/// What to do with one query: answered at once (REFUSED, NODATA,
/// SERVFAIL without an upstream: no waiting, so no slot), dropped (not a
/// query), or forwarded (and its answer learned for `learn_for`).
enum Plan {
    Reply(Vec<u8>),
    Drop,
    Forward {
        q: Question,
        upstream: SocketAddrV4,
        learn_for: Option<String>,
    },
}

fn plan(
    agent: &impl EgressPolicy,
    upstream: Option<SocketAddrV4>,
    src: Ipv4Addr,
    query: &[u8],
) -> Plan {
    let Some(q) = parse_query(query) else {
        return Plan::Drop;
    };
    let learn_for = match agent.dns_decide(src, &q.name) {
        DnsDecision::Stranger | DnsDecision::Refuse { .. } | DnsDecision::Offline { .. } => {
            return Plan::Reply(reply(query, &q, RCODE_REFUSED));
        }
        // A sandbox whose IPv6 does not reach the world (no IPv6 egress on
        // the node, or rules that are IPv4's only: docs/dual-stack.md):
        // an IPv6 address would be a connection that fails, so a
        // dual-stack client is told at once that there is none.
        _ if q.qtype == TYPE_AAAA && !agent.dns_aaaa(src) => {
            return Plan::Reply(reply(query, &q, 0));
        }
        DnsDecision::Forward => None,
        // Their hints (ipv4hint) would be addresses never learned: a
        // client falls back to A.
        DnsDecision::Learn { .. } if matches!(q.qtype, TYPE_SVCB | TYPE_HTTPS) => {
            return Plan::Reply(reply(query, &q, 0));
        }
        DnsDecision::Learn { sandbox_id } => Some(sandbox_id),
    };
    match upstream {
        None => Plan::Reply(reply(query, &q, RCODE_SERVFAIL)),
        Some(upstream) => Plan::Forward {
            q,
            upstream,
            learn_for,
        },
    }
}

/// Forwards a planned query and learns its answer; the reply to send.
/// Over UDP (`udp_limit`: the most the client takes) the query goes out
/// advertising no more than that, and an answer still larger is cut to
/// its question with TC set (nothing learned: the client asks again over
/// TCP); over TCP (`None`) the answer goes as it is.
async fn forward_and_learn(
    agent: &impl EgressPolicy,
    src: Ipv4Addr,
    query: &[u8],
    (q, upstream, learn_for): (Question, SocketAddrV4, Option<String>),
    udp_limit: Option<usize>,
) -> Vec<u8> {
    let forwarded = match udp_limit {
        None => forward_tcp(upstream, query).await,
        Some(limit) => forward(upstream, &clamp_edns(query, limit), q.id).await,
    };
    agent.upstream_outcome(forwarded.as_ref().map(|_| ()));
    let Ok(resp) = forwarded else {
        return reply(query, &q, RCODE_SERVFAIL);
    };
    if udp_limit.is_some_and(|l| resp.len() > l) {
        return truncated(query, &q, &resp);
    }
    if let Some(sandbox_id) = learn_for {
        let addrs = answer_addrs(&resp, &q.name).unwrap_or_default();
        if agent
            .dns_learn(src, &sandbox_id, &q.name, &addrs)
            .await
            .is_err()
        {
            return reply(query, &q, RCODE_SERVFAIL);
        }
    }
    resp
}

/// The answer to one query over TCP from `src`, or `None` to drop it (not
/// a query).
async fn answer(
    agent: &impl EgressPolicy,
    upstream: Option<SocketAddrV4>,
    src: Ipv4Addr,
    query: &[u8],
) -> Option<Vec<u8>> {
    match plan(agent, upstream, src, query) {
        Plan::Reply(r) => Some(r),
        Plan::Drop => None,
        Plan::Forward {
            q,
            upstream,
            learn_for,
        } => Some(forward_and_learn(agent, src, query, (q, upstream, learn_for), None).await),
    }
}

/// Asks the upstream something every resolver answers (the root's NS
/// records): whether it answers at all, for Health when no sandbox asked
/// anything lately.
pub async fn probe(upstream: SocketAddrV4) -> std::io::Result<()> {
    let id = rand_id();
    forward(upstream, &encode_query(id, ".", 2), id)
        .await
        .map(|_| ())
}

/// Sends the query to the upstream over a TCP connection of its own.
async fn forward_tcp(upstream: SocketAddrV4, query: &[u8]) -> std::io::Result<Vec<u8>> {
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        let mut c = TcpStream::connect(upstream).await?;
        let mut out = (query.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(query);
        c.write_all(&out).await?;
        let mut len = [0u8; 2];
        c.read_exact(&mut len).await?;
        let mut resp = vec![0u8; u16::from_be_bytes(len) as usize];
        c.read_exact(&mut resp).await?;
        if resp.len() < 12 || resp[..2] != query[..2] {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidData));
        }
        Ok(resp)
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

/// Sends the query to the upstream from a socket of its own and waits for
/// the reply with the same id.
async fn forward(upstream: SocketAddrV4, query: &[u8], id: u16) -> std::io::Result<Vec<u8>> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    sock.connect(upstream).await?;
    sock.send(query).await?;
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            // Sized to the datagram (up to 64 KiB): a query in flight does
            // not hold a 64 KiB buffer while it waits.
            sock.readable().await?;
            let len = match sock.try_io(tokio::io::Interest::READABLE, || {
                use nix::sys::socket::{MsgFlags, recv};
                recv(
                    sock.as_raw_fd(),
                    &mut [0u8; 1],
                    MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC,
                )
                .map_err(std::io::Error::from)
            }) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => r?,
            };
            let mut buf = vec![0u8; len.clamp(1, MAX_MESSAGE)];
            let n = match sock.try_recv(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => r?,
            };
            if n >= 12 && u16_at(&buf, 0) == Some(id) && buf[2] & 0x80 != 0 {
                buf.truncate(n);
                return Ok(buf);
            }
        }
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

#[cfg(test)]
mod tests {
    use super::encode_query as query;
    use super::*;
    use crate::policy::MAX_IN_FLIGHT;

    fn rr(m: &mut Vec<u8>, owner_ptr: u16, rtype: u16, ttl: u32, data: &[u8]) {
        m.extend_from_slice(&(0xc000 | owner_ptr).to_be_bytes());
        m.extend_from_slice(&rtype.to_be_bytes());
        m.extend_from_slice(&CLASS_IN.to_be_bytes());
        m.extend_from_slice(&ttl.to_be_bytes());
        m.extend_from_slice(&(data.len() as u16).to_be_bytes());
        m.extend_from_slice(data);
    }

    #[test]
    fn parses_a_query_and_answers_it() {
        let q = query(0x1234, "WWW.Allowed.test", TYPE_A);
        let p = parse_query(&q).unwrap();
        assert_eq!(
            (p.id, p.name.as_str(), p.qtype, p.end),
            (0x1234, "www.allowed.test", 1, q.len())
        );
        let r = reply(&q, &p, RCODE_REFUSED);
        assert_eq!(&r[..2], &[0x12, 0x34]);
        assert_eq!(r[2], 0x81, "QR + RD");
        assert_eq!(r[3] & 0x0f, RCODE_REFUSED);
        assert_eq!(&r[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&r[12..], &q[12..]);
        // Responses, other opcodes, truncated messages: not queries.
        let mut resp = q.clone();
        resp[2] |= 0x80;
        assert_eq!(parse_query(&resp), None);
        assert_eq!(parse_query(&q[..q.len() - 3]), None);
        assert_eq!(parse_query(&[0; 5]), None);
    }

    #[test]
    fn shares_leave_room_for_one_more_source() {
        let s = Shares::new(64, 16);
        let ip = |i: u8| Ipv4Addr::new(192, 168, 0, i);
        let take_all = |i: u8| std::iter::from_fn(|| s.try_take(ip(i))).collect::<Vec<Held>>();
        // One source alone: its cap, never all.
        assert_eq!(take_all(1).len(), 16);
        // 20 sources, each taking all it may; then each in turn finishes
        // its work and takes slots again (a flood): within one such round
        // the slots in use leave room for a source that holds none.
        let mut held: Vec<Vec<Held>> = (1..=20).map(take_all).collect();
        assert!(s.used() <= 64);
        for round in 0..3 {
            for (i, h) in held.iter_mut().enumerate() {
                h.clear();
                *h = take_all(i as u8 + 1);
            }
            assert!(s.used() < 64, "round {round}: {} used", s.used());
            let newcomer = s.try_take(ip(100));
            assert!(newcomer.is_some(), "round {round}: none for a newcomer");
        }
        held.clear();
        assert_eq!(s.used(), 0);
        // The resolver's numbers: eight sources flooding leave most of the
        // slots to everyone else, at once.
        let s = Shares::new(MAX_IN_FLIGHT, MAX_UDP_PER_SOURCE);
        let flood: Vec<Vec<Held>> = (1..=8u8)
            .map(|i| std::iter::from_fn(|| s.try_take(ip(i))).collect())
            .collect();
        assert!(flood.iter().all(|f| f.len() == MAX_UDP_PER_SOURCE));
        assert_eq!(s.used(), 8 * MAX_UDP_PER_SOURCE);
        assert!(s.try_take(ip(100)).is_some());
    }

    /// An OPT record (EDNS) of `size` in the additional section.
    fn with_edns(mut q: Vec<u8>, size: u16) -> Vec<u8> {
        q[11] = 1; // ARCOUNT
        q.extend_from_slice(&[0, 0, 41]);
        q.extend_from_slice(&size.to_be_bytes());
        q.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        q
    }

    #[test]
    fn udp_answers_fit_the_client_and_its_link() {
        let plain = query(1, "www.allowed.test", TYPE_A);
        let edns = with_edns(plain.clone(), 4096);
        assert_eq!(edns_at(&edns).map(|e| e.1), Some(4096));
        assert_eq!(edns_at(&plain), None);
        // Without EDNS: 512; with it: what it says, but never more than a
        // datagram of the sandbox's MTU carries.
        assert_eq!(udp_limit(&plain, 1300), 512);
        assert_eq!(udp_limit(&edns, 1300), 1272);
        assert_eq!(udp_limit(&edns, 9000), 4096);
        assert_eq!(udp_limit(&with_edns(plain.clone(), 100), 1300), 512);
        // The query goes upstream advertising no more than that.
        let clamped = clamp_edns(&edns, 1272);
        assert_eq!(edns_at(&clamped).map(|e| e.1), Some(1272));
        assert_eq!(&clamped[..12], &edns[..12]);
        // A larger answer: its question, TC set, no records.
        let p = parse_query(&edns).unwrap();
        let mut resp = edns.clone();
        resp[2] |= 0x80;
        resp[7] = 1;
        resp.extend(std::iter::repeat_n(0u8, 2000));
        let t = truncated(&edns, &p, &resp);
        assert_eq!(t[2] & 0x82, 0x82, "QR and TC");
        assert_eq!(&t[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(t.len(), p.end);
    }

    #[test]
    fn a_and_aaaa_records_along_the_cname_chain_only() {
        let mut m = query(7, "a.allowed.test", TYPE_A);
        m[2] |= 0x80;
        m[7] = 6; // ANCOUNT
        // a.allowed.test CNAME b.cdn.test; b.cdn.test A 192.0.2.1;
        // a.allowed.test A 192.0.2.2; other.test A 192.0.2.3 (unrelated)
        let target_at = m.len() + 12;
        let cname = [1, b'b', 3, b'c', b'd', b'n', 4, b't', b'e', b's', b't', 0];
        rr(&mut m, 12, TYPE_CNAME, 60, &cname);
        rr(&mut m, target_at as u16, TYPE_A, 30, &[192, 0, 2, 1]);
        rr(&mut m, 12, TYPE_A, 300, &[192, 0, 2, 2]);
        // An AAAA record of the chain, and one of the wrong length.
        let v6: std::net::Ipv6Addr = "2001:db8::7".parse().unwrap();
        rr(&mut m, target_at as u16, TYPE_AAAA, 40, &v6.octets());
        rr(&mut m, 12, TYPE_AAAA, 40, &[192, 0, 2, 9]);
        // An uncompressed owner "other.test".
        m.extend_from_slice(&[
            5, b'o', b't', b'h', b'e', b'r', 4, b't', b'e', b's', b't', 0,
        ]);
        m.extend_from_slice(&TYPE_A.to_be_bytes());
        m.extend_from_slice(&CLASS_IN.to_be_bytes());
        m.extend_from_slice(&5u32.to_be_bytes());
        m.extend_from_slice(&4u16.to_be_bytes());
        m.extend_from_slice(&[192, 0, 2, 3]);
        let got = answer_addrs(&m, "a.allowed.test").unwrap();
        assert_eq!(
            got,
            vec![
                (Ipv4Addr::new(192, 0, 2, 1).into(), 30),
                (Ipv4Addr::new(192, 0, 2, 2).into(), 300),
                (v6.into(), 40),
            ]
        );
        // A pointer loop or a pointer forward is refused, not followed.
        let mut bad = query(1, "x.test", TYPE_A);
        bad[12] = 0xc0;
        bad[13] = 12;
        assert_eq!(parse_query(&bad), None);
    }
}
