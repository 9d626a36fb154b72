//! The resolver for sandboxes (docs/egress.md), a wire edge: DNS over UDP
//! and TCP on the gateway device's address, port 53 (what a guest reaches
//! at its gateway). It parses the question, asks the core
//! ([`Agent::dns_decide`]), answers REFUSED or NODATA itself, or forwards
//! the query to the upstream resolver and, for a sandbox with domain
//! rules, has the answer's addresses learned ([`Agent::dns_learn`])
//! before the answer is sent on.

pub mod proxy;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tracing::{debug, info, warn};

use crate::agent::Agent;
use crate::agent::egress::DnsDecision;

/// How long the upstream has to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Queries handled at once; more wait in the socket's buffer.
const MAX_IN_FLIGHT: usize = 256;
/// UDP queries in flight from one source address (each may wait for the
/// upstream up to [`UPSTREAM_TIMEOUT`]): beyond, its datagrams are
/// dropped, so one sandbox cannot hold every slot the others need.
const MAX_UDP_PER_SOURCE: usize = 32;
/// DNS over TCP: connections at once, per source address, and how long
/// one may sit idle.
const MAX_TCP: usize = 128;
const MAX_TCP_PER_SOURCE: usize = 4;
const TCP_IDLE: Duration = Duration::from_secs(5);

const TYPE_A: u16 = 1;
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

/// The IPv4 addresses an answer gives for `name`, with their TTLs: A
/// records of the name or of a name it is a CNAME of within this answer
/// (in order), nothing from the authority or additional sections.
pub fn answer_addrs(m: &[u8], name: &str) -> Option<Vec<(Ipv4Addr, u32)>> {
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
            .filter(|(owner, rtype, class, _, _, len)| {
                *rtype == TYPE_A && *class == CLASS_IN && *len == 4 && chain.contains(owner)
            })
            .map(|(_, _, _, ttl, data, _)| {
                (
                    Ipv4Addr::new(m[*data], m[data + 1], m[data + 2], m[data + 3]),
                    *ttl,
                )
            })
            .collect(),
    )
}

/// Sockets handed back by the fd store, by name
/// (`systemd::SOCKET_FD_NAMES`).
pub type Passed = std::collections::HashMap<String, OwnedFd>;

/// The socket `name` bound to `at`: the one the fd store handed back if it
/// is that (same type, same address), else a new one, which goes into the
/// fd store, so that the next start finds it with what arrived meanwhile
/// (queries, connections) queued.
fn adopt_or_bind(
    passed: &mut Passed,
    name: &str,
    at: SocketAddrV4,
    udp: bool,
) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{SockType, SockaddrIn, getsockname, getsockopt, sockopt};
    if let Some(fd) = passed.remove(name) {
        let want = if udp {
            SockType::Datagram
        } else {
            SockType::Stream
        };
        let same = getsockopt(&fd, sockopt::SockType).is_ok_and(|t| t == want)
            && getsockname::<SockaddrIn>(fd.as_raw_fd()).is_ok_and(|a| SocketAddrV4::from(a) == at);
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

/// Binds the resolver and serves it on the runtime. A failed bind is
/// reported to the caller (the agent runs on; sandboxes with domain rules
/// then resolve nothing).
pub fn serve(
    agent: Arc<Agent>,
    upstream: Option<SocketAddrV4>,
    passed: &mut Passed,
) -> std::io::Result<SocketAddrV4> {
    let at = SocketAddrV4::new(agent.resolver_address(), 53);
    let bound = bind(agent.clone(), upstream, at, passed);
    agent.resolver_status(match &bound {
        Ok(()) => match upstream {
            Some(u) => Ok(format!("listening on {at} (UDP, TCP), upstream {u}")),
            None => Err(format!(
                "listening on {at}, but no upstream (dns_upstream, /etc/resolv.conf): allowed queries get SERVFAIL"
            )),
        },
        Err(e) => Err(format!("binding {at}: {e}")),
    });
    bound.map(|()| at)
}

fn bind(
    agent: Arc<Agent>,
    upstream: Option<SocketAddrV4>,
    at: SocketAddrV4,
    passed: &mut Passed,
) -> std::io::Result<()> {
    let std_sock = std::net::UdpSocket::from(adopt_or_bind(passed, "dns-udp", at, true)?);
    std_sock.set_nonblocking(true)?;
    // Which device each query came in on: see `recv_query`.
    nix::sys::socket::setsockopt(&std_sock, nix::sys::socket::sockopt::Ipv4PacketInfo, &true)
        .map_err(std::io::Error::from)?;
    let gateway_ifindex = agent.resolver_ifindex();
    let sock = Arc::new(UdpSocket::from_std(std_sock)?);
    let std_listener = std::net::TcpListener::from(adopt_or_bind(passed, "dns-tcp", at, false)?);
    std_listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(std_listener)?;
    tokio::spawn(serve_tcp(agent.clone(), upstream, listener));
    match upstream {
        Some(u) => info!(address = %at, upstream = %u, "dns: resolver for sandboxes"),
        None => {
            warn!(address = %at, "dns: no upstream (dns_upstream, /etc/resolv.conf): allowed queries get SERVFAIL")
        }
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let per_source = PerSource::default();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
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
                *from.ip()
            } else {
                Ipv4Addr::UNSPECIFIED
            };
            let query = &buf[..n];
            // Answered at once when nothing is to wait for (a burst queued
            // while the agent restarted is not cut by the caps below).
            let (q, upstream, learn_for) = match plan(&agent, upstream, src, query) {
                Plan::Drop => continue,
                Plan::Reply(r) => {
                    if sock.try_send_to(&r, from.into()).is_err() {
                        let _ = sock.send_to(&r, from).await;
                    }
                    continue;
                }
                Plan::Forward {
                    q,
                    upstream,
                    learn_for,
                } => (q, upstream, learn_for),
            };
            let Some(held) = per_source.take(src, MAX_UDP_PER_SOURCE) else {
                continue; // dropped: the client retries
            };
            let Ok(permit) = slots.clone().acquire_owned().await else {
                break;
            };
            let query = query.to_vec();
            let (agent, sock) = (agent.clone(), sock.clone());
            tokio::spawn(async move {
                let answer =
                    forward_and_learn(&agent, src, &query, (q, upstream, learn_for), false).await;
                let _ = sock.send_to(&answer, from).await;
                drop((permit, held));
            });
        }
    });
    Ok(())
}

/// One datagram: its length, its source and the device it came in on
/// (IP_PKTINFO).
async fn recv_query(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> std::io::Result<(usize, SocketAddrV4, u32)> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg};
    loop {
        sock.readable().await?;
        let got = sock.try_io(tokio::io::Interest::READABLE, || {
            let mut iov = [std::io::IoSliceMut::new(buf)];
            let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
            let m = recvmsg::<SockaddrIn>(
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
                    _ => None,
                })
                .unwrap_or(0);
            let from = m
                .address
                .map(|a| SocketAddrV4::new(a.ip(), a.port()))
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
async fn serve_tcp(agent: Arc<Agent>, upstream: Option<SocketAddrV4>, listener: TcpListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_TCP));
    let per_source = PerSource::default();
    loop {
        let (mut conn, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                debug!(error = %e, "dns: accepting");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(from) = from else { continue };
        let src = *from.ip();
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            continue; // dropped: the client retries
        };
        let Some(held) = per_source.take(src, MAX_TCP_PER_SOURCE) else {
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
                let Some(a) = answer(&agent, upstream, src, &query, true).await else {
                    break;
                };
                let mut out = (a.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&a);
                if conn.write_all(&out).await.is_err() {
                    break;
                }
            }
            drop((permit, held));
        });
    }
}

/// Work in flight per source address (UDP queries, TCP connections).
#[derive(Clone, Default)]
struct PerSource(Arc<std::sync::Mutex<std::collections::HashMap<Ipv4Addr, usize>>>);

/// One unit of a source's work; given back on drop.
struct Held(PerSource, Ipv4Addr);

impl PerSource {
    fn take(&self, src: Ipv4Addr, max: usize) -> Option<Held> {
        let mut n = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let c = n.entry(src).or_default();
        if *c >= max {
            return None;
        }
        *c += 1;
        Some(Held(self.clone(), src))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut n = (self.0).0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = n.get_mut(&self.1) {
            *c -= 1;
            if *c == 0 {
                n.remove(&self.1);
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

fn plan(agent: &Agent, upstream: Option<SocketAddrV4>, src: Ipv4Addr, query: &[u8]) -> Plan {
    let Some(q) = parse_query(query) else {
        return Plan::Drop;
    };
    let learn_for = match agent.dns_decide(src, &q.name) {
        DnsDecision::Stranger | DnsDecision::Refuse { .. } => {
            return Plan::Reply(reply(query, &q, RCODE_REFUSED));
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
async fn forward_and_learn(
    agent: &Agent,
    src: Ipv4Addr,
    query: &[u8],
    (q, upstream, learn_for): (Question, SocketAddrV4, Option<String>),
    tcp: bool,
) -> Vec<u8> {
    let forwarded = if tcp {
        forward_tcp(upstream, query).await
    } else {
        forward(upstream, query, q.id).await
    };
    let Ok(resp) = forwarded else {
        return reply(query, &q, RCODE_SERVFAIL);
    };
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

/// The answer to one query from `src`, or `None` to drop it (not a query).
async fn answer(
    agent: &Agent,
    upstream: Option<SocketAddrV4>,
    src: Ipv4Addr,
    query: &[u8],
    tcp: bool,
) -> Option<Vec<u8>> {
    match plan(agent, upstream, src, query) {
        Plan::Reply(r) => Some(r),
        Plan::Drop => None,
        Plan::Forward {
            q,
            upstream,
            learn_for,
        } => Some(forward_and_learn(agent, src, query, (q, upstream, learn_for), tcp).await),
    }
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
    let mut buf = vec![0u8; 4096];
    tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            let n = sock.recv(&mut buf).await?;
            if n >= 12 && u16_at(&buf, 0) == Some(id) && buf[2] & 0x80 != 0 {
                return Ok(buf[..n].to_vec());
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
    fn a_records_along_the_cname_chain_only() {
        let mut m = query(7, "a.allowed.test", TYPE_A);
        m[2] |= 0x80;
        m[7] = 4; // ANCOUNT
        // a.allowed.test CNAME b.cdn.test; b.cdn.test A 192.0.2.1;
        // a.allowed.test A 192.0.2.2; other.test A 192.0.2.3 (unrelated)
        let target_at = m.len() + 12;
        let cname = [1, b'b', 3, b'c', b'd', b'n', 4, b't', b'e', b's', b't', 0];
        rr(&mut m, 12, TYPE_CNAME, 60, &cname);
        rr(&mut m, target_at as u16, TYPE_A, 30, &[192, 0, 2, 1]);
        rr(&mut m, 12, TYPE_A, 300, &[192, 0, 2, 2]);
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
                (Ipv4Addr::new(192, 0, 2, 1), 30),
                (Ipv4Addr::new(192, 0, 2, 2), 300)
            ]
        );
        // A pointer loop or a pointer forward is refused, not followed.
        let mut bad = query(1, "x.test", TYPE_A);
        bad[12] = 0xc0;
        bad[13] = 12;
        assert_eq!(parse_query(&bad), None);
    }
}
