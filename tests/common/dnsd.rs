//! A small authoritative DNS server for the egress tests: the answer is
//! spelled by the name asked, so one server covers every case (dnsmasq
//! cannot answer with thousands of records, hold a query, or send a UDP
//! answer larger than the client asked for). Serves UDP and TCP on
//! `<ip>:53` inside a network namespace, on threads, until dropped.
//!
//! The first label of the name decides (the zone is free, so a test picks
//! one its patterns allow or refuse):
//!
//! | first label | answer |
//! |---|---|
//! | `A-B-C-D` | A a.b.c.d, TTL 60 |
//! | `ttl-T-A-B-C-D` | A a.b.c.d, TTL T |
//! | `cn-A-B-C-D` | CNAME `A-B-C-D.ip.test`, then its A record |
//! | `many-N` | N A records 11.0.0.1, 11.0.0.2, ... (TTL 60) |
//! | `pad-N-A-B-C-D` | A a.b.c.d, padded with TXT records in the additional section to about N bytes |
//! | `huge-N-A-B-C-D` | the same, sent over UDP whatever size the client advertised |
//! | `slow-...` | nothing: the query is never answered |
//! | anything else | NXDOMAIN |
//!
//! Other query types of a known name get NODATA; `. NS` (what a health
//! probe asks) gets an empty NOERROR. Over UDP an answer larger than the
//! query's EDNS size (512 without EDNS) is truncated to its question with
//! TC set, except for `huge-`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::world::in_netns;

const TYPE_A: u16 = 1;
const TYPE_NS: u16 = 2;
const TYPE_CNAME: u16 = 5;
const TYPE_TXT: u16 = 16;
const TYPE_OPT: u16 = 41;

pub struct Dnsd {
    pub addr: SocketAddrV4,
    /// Queries received (UDP and TCP).
    pub queries: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Dnsd {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Dnsd {
    /// Serves on `ip`:53 in the named network namespace.
    pub fn start(ns: &str, ip: Ipv4Addr) -> Dnsd {
        let addr = SocketAddrV4::new(ip, 53);
        let (udp, tcp) = in_netns(ns, move || {
            (
                UdpSocket::bind(addr).expect("dnsd: UDP bind"),
                TcpListener::bind(addr).expect("dnsd: TCP bind"),
            )
        });
        udp.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        tcp.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let queries = Arc::new(AtomicU64::new(0));
        let mut threads = vec![];
        {
            let (stop, queries) = (stop.clone(), queries.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = udp.recv_from(&mut buf) else {
                        continue;
                    };
                    queries.fetch_add(1, Ordering::Relaxed);
                    if let Some(r) = respond(&buf[..n], true) {
                        let _ = udp.send_to(&r, from);
                    }
                }
            }));
        }
        {
            let (stop, queries) = (stop.clone(), queries.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match tcp.accept() {
                        Ok((c, _)) => {
                            let (stop, queries) = (stop.clone(), queries.clone());
                            std::thread::spawn(move || serve_tcp(c, &stop, &queries));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            }));
        }
        Dnsd {
            addr,
            queries,
            stop,
            threads,
        }
    }
}

fn serve_tcp(mut c: TcpStream, stop: &AtomicBool, queries: &AtomicU64) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
    let mut held = false;
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let mut len = [0u8; 2];
        match c.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => {
                // A slow query's connection stays open until the end.
                while held && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return;
            }
        }
        let mut q = vec![0u8; u16::from_be_bytes(len) as usize];
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        if c.read_exact(&mut q).is_err() {
            return;
        }
        let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
        queries.fetch_add(1, Ordering::Relaxed);
        match respond(&q, false) {
            Some(r) => {
                let mut out = (r.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&r);
                if c.write_all(&out).is_err() {
                    return;
                }
            }
            None => held = true,
        }
    }
}

/// The question: (id, name as sent, lowercase name, qtype, end of question,
/// EDNS size if the query has an OPT record).
fn question(q: &[u8]) -> Option<(String, u16, usize, Option<u16>)> {
    if q.len() < 12 {
        return None;
    }
    let mut at = 12;
    let mut labels = vec![];
    loop {
        let l = *q.get(at)? as usize;
        at += 1;
        if l == 0 {
            break;
        }
        if l >= 64 {
            return None;
        }
        labels.push(String::from_utf8_lossy(q.get(at..at + l)?).to_ascii_lowercase());
        at += l;
    }
    let qtype = u16::from_be_bytes([*q.get(at)?, *q.get(at + 1)?]);
    let end = at + 4;
    q.get(..end)?;
    // An OPT record in the additional section: root name, type 41, class
    // = the UDP payload size.
    let arcount = u16::from_be_bytes([q[10], q[11]]);
    let mut edns = None;
    if arcount > 0 && q.get(end) == Some(&0) {
        let t = u16::from_be_bytes([*q.get(end + 1)?, *q.get(end + 2)?]);
        if t == TYPE_OPT {
            edns = Some(u16::from_be_bytes([*q.get(end + 3)?, *q.get(end + 4)?]));
        }
    }
    Some((labels.join("."), qtype, end, edns))
}

fn ip_of(parts: &[&str]) -> Option<Ipv4Addr> {
    if parts.len() != 4 {
        return None;
    }
    let o: Vec<u8> = parts
        .iter()
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    Some(Ipv4Addr::new(o[0], o[1], o[2], o[3]))
}

/// A record with a compressed owner (`ptr` into the message).
fn rr(m: &mut Vec<u8>, owner_ptr: u16, rtype: u16, ttl: u32, data: &[u8]) {
    m.extend_from_slice(&(0xc000 | owner_ptr).to_be_bytes());
    m.extend_from_slice(&rtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m.extend_from_slice(&ttl.to_be_bytes());
    m.extend_from_slice(&(data.len() as u16).to_be_bytes());
    m.extend_from_slice(data);
}

fn encode_name(name: &str) -> Vec<u8> {
    let mut out = vec![];
    for l in name.split('.').filter(|l| !l.is_empty()) {
        out.push(l.len() as u8);
        out.extend_from_slice(l.as_bytes());
    }
    out.push(0);
    out
}

/// The answer to query `q`, or `None` to leave it unanswered.
pub fn respond(q: &[u8], udp: bool) -> Option<Vec<u8>> {
    let (name, qtype, end, edns) = question(q)?;
    let first = name.split('.').next().unwrap_or_default().to_owned();
    let parts: Vec<&str> = first.split('-').collect();
    if parts[0] == "slow" {
        return None;
    }
    let mut m = q[..end].to_vec();
    // QR, AA, the query's RD; RA; counts: one question, no others yet.
    m[2] = 0x84 | (q[2] & 0x01);
    m[3] = 0x80;
    m[6..12].fill(0);
    let (mut an, mut ar) = (0u16, 0u16);
    let mut known = true;
    let mut huge = false;
    if name.is_empty() {
        // `. NS`: an empty NOERROR.
    } else if let Some(ip) = ip_of(&parts) {
        if qtype == TYPE_A {
            rr(&mut m, 12, TYPE_A, 60, &ip.octets());
            an = 1;
        }
    } else if parts[0] == "ttl" && parts.len() == 6 {
        let (Ok(ttl), Some(ip)) = (parts[1].parse::<u32>(), ip_of(&parts[2..])) else {
            return None;
        };
        if qtype == TYPE_A {
            rr(&mut m, 12, TYPE_A, ttl, &ip.octets());
            an = 1;
        }
    } else if parts[0] == "cn" && parts.len() == 5 {
        let ip = ip_of(&parts[1..])?;
        if qtype == TYPE_A {
            let target = format!("{}.ip.test", parts[1..].join("-"));
            let target_at = m.len() + 12;
            rr(&mut m, 12, TYPE_CNAME, 60, &encode_name(&target));
            rr(&mut m, target_at as u16, TYPE_A, 60, &ip.octets());
            an = 2;
        }
    } else if parts[0] == "many" && parts.len() == 2 {
        let n: u32 = parts[1].parse().ok()?;
        if qtype == TYPE_A {
            let base = u32::from(Ipv4Addr::new(11, 0, 0, 1));
            for i in 0..n {
                rr(&mut m, 12, TYPE_A, 60, &Ipv4Addr::from(base + i).octets());
            }
            an = n as u16;
        }
    } else if (parts[0] == "pad" || parts[0] == "huge") && parts.len() == 6 {
        let size: usize = parts[1].parse().ok()?;
        let ip = ip_of(&parts[2..])?;
        huge = parts[0] == "huge";
        if qtype == TYPE_A {
            rr(&mut m, 12, TYPE_A, 60, &ip.octets());
            an = 1;
            // TXT records of up to 255 characters until about `size`.
            while m.len() + 12 + 2 < size {
                let room = (size - m.len() - 12 - 1).clamp(1, 255);
                let mut txt = vec![room as u8];
                txt.extend(std::iter::repeat_n(b'x', room));
                rr(&mut m, 12, TYPE_TXT, 60, &txt);
                ar += 1;
            }
        }
    } else {
        known = false;
    }
    if !known {
        m[3] = 0x83; // NXDOMAIN
    }
    let _ = TYPE_NS;
    m[6..8].copy_from_slice(&an.to_be_bytes());
    m[10..12].copy_from_slice(&ar.to_be_bytes());
    let limit = usize::from(edns.unwrap_or(512)).max(512);
    if udp && !huge && m.len() > limit {
        // Truncated: the question only, TC set.
        m.truncate(end);
        m[2] |= 0x02;
        m[6..12].fill(0);
    }
    Some(m)
}
