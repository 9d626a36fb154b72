//! The host's own sockets, as the kernel lists them in `/proc/net/{tcp,
//! tcp6,udp,udp6}` (the agent's network namespace): a port mapping must
//! never take a port on which the host already listens (TCP) or has a bound
//! socket (UDP). Read once per EnsureNetwork that claims a new host port,
//! outside every lock.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::alloc::Protocol;

/// TCP_LISTEN in `/proc/net/tcp`'s `st` column.
const TCP_LISTEN: u8 = 0x0a;

/// One host socket bound to a local port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSocket {
    pub protocol: Protocol,
    pub addr: IpAddr,
    pub port: u16,
    pub uid: u32,
    pub inode: u64,
}

impl HostSocket {
    /// Whether this socket receives what arrives for `host_ip:port`
    /// (`0.0.0.0` = every address of the node).
    fn covers(&self, protocol: Protocol, host_ip: Ipv4Addr, port: u16) -> bool {
        if self.protocol != protocol || self.port != port {
            return false;
        }
        let v4 = match self.addr {
            IpAddr::V4(a) => a,
            // A dual-stack wildcard listener takes IPv4 too; an IPv4-mapped
            // address is that IPv4 address; other IPv6 addresses never see
            // IPv4 traffic.
            IpAddr::V6(a) if a.is_unspecified() => Ipv4Addr::UNSPECIFIED,
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => v4,
                None => return false,
            },
        };
        v4.is_unspecified() || host_ip.is_unspecified() || v4 == host_ip
    }
}

impl std::fmt::Display for HostSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.protocol {
            Protocol::Tcp => "listening",
            Protocol::Udp => "bound",
        };
        let addr = match self.addr {
            IpAddr::V4(a) => a.to_string(),
            IpAddr::V6(a) => format!("[{a}]"),
        };
        write!(
            f,
            "a host socket is {what} on {addr}:{} (uid {}, socket inode {})",
            self.port, self.uid, self.inode
        )
    }
}

/// A snapshot of the host's listening TCP and bound UDP sockets.
#[derive(Debug, Clone, Default)]
pub struct HostSockets {
    sockets: Vec<HostSocket>,
}

impl HostSockets {
    /// Reads the kernel's socket tables. A table that cannot be read (no
    /// IPv6 in this kernel) is skipped; the others still count.
    ///
    /// TCP listeners come from sock_diag asking for LISTEN sockets only:
    /// the kernel then walks just its listening hash. `/proc/net/tcp[6]`
    /// walks the whole established hash of the machine (262,144 buckets by
    /// default) even in an empty namespace, ~1.7 ms per file; it is the
    /// fallback when sock_diag is unavailable. UDP has one table, read
    /// from `/proc/net/udp[6]` (~0.1 ms).
    pub fn scan() -> HostSockets {
        match diag::tcp_listeners() {
            Ok(mut sockets) => {
                sockets.extend(read_tables(&UDP_TABLES));
                HostSockets { sockets }
            }
            Err(_) => HostSockets::scan_proc(),
        }
    }

    /// [`HostSockets::scan`] from the `/proc` tables only.
    pub fn scan_proc() -> HostSockets {
        let mut sockets = read_tables(&TCP_TABLES);
        sockets.extend(read_tables(&UDP_TABLES));
        HostSockets { sockets }
    }

    /// The host socket that owns `host_ip:port`, if any.
    pub fn owner(&self, protocol: Protocol, host_ip: Ipv4Addr, port: u16) -> Option<&HostSocket> {
        self.owners(protocol, host_ip, port).next()
    }

    /// Every host socket that receives what arrives for `host_ip:port`.
    pub fn owners(
        &self,
        protocol: Protocol,
        host_ip: Ipv4Addr,
        port: u16,
    ) -> impl Iterator<Item = &HostSocket> {
        self.sockets
            .iter()
            .filter(move |s| s.covers(protocol, host_ip, port))
    }

    /// Every socket on `port` (any address).
    pub fn on_port(&self, protocol: Protocol, port: u16) -> impl Iterator<Item = &HostSocket> {
        self.sockets
            .iter()
            .filter(move |s| s.protocol == protocol && s.port == port)
    }
}

const TCP_TABLES: [(&str, Protocol); 2] = [
    ("/proc/net/tcp", Protocol::Tcp),
    ("/proc/net/tcp6", Protocol::Tcp),
];
const UDP_TABLES: [(&str, Protocol); 2] = [
    ("/proc/net/udp", Protocol::Udp),
    ("/proc/net/udp6", Protocol::Udp),
];

/// The sockets of each readable table (one that cannot be read, e.g. no
/// IPv6 in this kernel, is skipped).
fn read_tables(tables: &[(&str, Protocol)]) -> Vec<HostSocket> {
    tables
        .iter()
        .filter_map(|(file, protocol)| Some(parse(&std::fs::read_to_string(file).ok()?, *protocol)))
        .flatten()
        .collect()
}

/// Parses one `/proc/net/{tcp,udp}[6]` table: listening TCP sockets and
/// every UDP socket (bound, connected or not).
fn parse(text: &str, protocol: Protocol) -> Vec<HostSocket> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, state, uid, inode) = (f.get(1)?, f.get(3)?, f.get(7)?, f.get(9)?);
            let state = u8::from_str_radix(state, 16).ok()?;
            if protocol == Protocol::Tcp && state != TCP_LISTEN {
                return None;
            }
            let (addr, port) = local.split_once(':')?;
            Some(HostSocket {
                protocol,
                addr: parse_addr(addr)?,
                port: u16::from_str_radix(port, 16).ok()?,
                uid: uid.parse().ok()?,
                inode: inode.parse().ok()?,
            })
        })
        .collect()
}

/// The kernel prints each 32-bit word of the address as a native-endian
/// `%08X`.
fn parse_addr(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => None,
    }
}

/// Listening TCP sockets through NETLINK_SOCK_DIAG (`inet_diag`).
mod diag {
    use std::io;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::{HostSocket, TCP_LISTEN};
    use crate::alloc::Protocol;

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const NLMSG_HDR: usize = 16;
    /// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, and a
    /// 48-byte `inet_diag_sockid`.
    const REQ_LEN: usize = 4 + 4 + 48;
    /// `struct inet_diag_msg`: 4 bytes, the 48-byte sockid, expires, rqueue,
    /// wqueue, uid, inode.
    const MSG_LEN: usize = 4 + 48 + 20;

    pub fn tcp_listeners() -> io::Result<Vec<HostSocket>> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh socket we own from here on.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut out = vec![];
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            dump(&sock, family, &mut out)?;
        }
        Ok(out)
    }

    fn dump(sock: &OwnedFd, family: u8, out: &mut Vec<HostSocket>) -> io::Result<()> {
        let mut req = [0u8; NLMSG_HDR + REQ_LEN];
        let len = req.len() as u32;
        req[0..4].copy_from_slice(&len.to_ne_bytes());
        req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        req[6..8].copy_from_slice(&flags.to_ne_bytes());
        req[8..12].copy_from_slice(&1u32.to_ne_bytes());
        let body = &mut req[NLMSG_HDR..];
        body[0] = family;
        body[1] = libc::IPPROTO_TCP as u8;
        body[4..8].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
        // SAFETY: sends req.len() initialised bytes from a live buffer on a
        // socket we own; the kernel address is all zeros (nl_pid 0).
        let sent = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as u16;
            libc::sendto(
                sock.as_raw_fd(),
                req.as_ptr().cast(),
                req.len(),
                0,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: the kernel writes at most buf.len() bytes into buf.
            let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= NLMSG_HDR {
                let mlen = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
                let mtype = u16::from_ne_bytes(rest[4..6].try_into().unwrap());
                if mlen < NLMSG_HDR || mlen > rest.len() {
                    return Err(io::Error::other("truncated sock_diag message"));
                }
                match mtype {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let errno = rest
                            .get(NLMSG_HDR..NLMSG_HDR + 4)
                            .map(|b| i32::from_ne_bytes(b.try_into().unwrap()))
                            .unwrap_or(-libc::EIO);
                        if errno == 0 {
                            return Ok(());
                        }
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    SOCK_DIAG_BY_FAMILY => {
                        if let Some(s) = parse_msg(&rest[NLMSG_HDR..mlen]) {
                            out.push(s);
                        }
                    }
                    _ => {}
                }
                let aligned = (mlen + 3) & !3;
                rest = rest.get(aligned..).unwrap_or(&[]);
            }
        }
    }

    fn parse_msg(m: &[u8]) -> Option<HostSocket> {
        if m.len() < MSG_LEN || m[1] != TCP_LISTEN {
            return None;
        }
        let port = u16::from_be_bytes([m[4], m[5]]);
        let src = &m[8..24];
        let addr = match i32::from(m[0]) {
            libc::AF_INET => IpAddr::V4(Ipv4Addr::new(src[0], src[1], src[2], src[3])),
            libc::AF_INET6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(src).ok()?)),
            _ => return None,
        };
        let word = |i: usize| u32::from_ne_bytes(m[i..i + 4].try_into().unwrap());
        Some(HostSocket {
            protocol: Protocol::Tcp,
            addr,
            port,
            uid: word(52 + 12),
            inode: u64::from(word(52 + 16)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex4(a: Ipv4Addr) -> String {
        format!("{:08X}", u32::from_ne_bytes(a.octets()))
    }

    #[test]
    fn parses_listeners_and_bound_udp() {
        let tcp = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: {}:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0\n\
             1: {}:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 2222 1 0 100 0 0 10 0\n\
             2: {}:9C40 {}:0050 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 100 0 0 10 0\n",
            hex4(Ipv4Addr::UNSPECIFIED),
            hex4(Ipv4Addr::LOCALHOST),
            hex4(Ipv4Addr::new(10, 0, 0, 1)),
            hex4(Ipv4Addr::new(10, 0, 0, 2)),
        );
        let s = HostSockets {
            sockets: parse(&tcp, Protocol::Tcp),
        };
        assert_eq!(s.sockets.len(), 2, "established sockets are not listeners");
        let any = Ipv4Addr::UNSPECIFIED;
        let node = Ipv4Addr::new(198, 51, 100, 1);
        // 0.0.0.0:22 covers every address.
        let o = s.owner(Protocol::Tcp, node, 22).unwrap();
        assert_eq!((o.uid, o.inode), (0, 1111));
        assert!(
            o.to_string().contains("listening on 0.0.0.0:22 (uid 0"),
            "{o}"
        );
        assert!(s.owner(Protocol::Udp, node, 22).is_none());
        // 127.0.0.1:8080 covers a loopback or wildcard mapping, not another address.
        assert!(s.owner(Protocol::Tcp, Ipv4Addr::LOCALHOST, 8080).is_some());
        assert!(s.owner(Protocol::Tcp, any, 8080).is_some());
        assert!(s.owner(Protocol::Tcp, node, 8080).is_none());
        assert!(s.owner(Protocol::Tcp, any, 40000).is_none());
    }

    #[test]
    fn parses_ipv6_wildcards_and_mapped_addresses() {
        let zero = "00000000000000000000000000000000";
        let mapped: String = {
            let b = Ipv4Addr::new(198, 51, 100, 1).to_ipv6_mapped().octets();
            (0..4)
                .map(|i| {
                    format!(
                        "{:08X}",
                        u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap())
                    )
                })
                .collect()
        };
        let udp = format!(
            "header\n\
             0: {zero}:0035 {zero}:0000 07 00000000:00000000 00:00000000 00000000   101        0 44 2 0\n\
             1: {mapped}:1388 {zero}:0000 07 00000000:00000000 00:00000000 00000000   0        0 55 2 0\n"
        );
        let s = HostSockets {
            sockets: parse(&udp, Protocol::Udp),
        };
        assert_eq!(s.sockets.len(), 2);
        let other = Ipv4Addr::new(203, 0, 113, 9);
        assert_eq!(s.owner(Protocol::Udp, other, 53).unwrap().uid, 101);
        assert!(
            s.owner(Protocol::Udp, Ipv4Addr::new(198, 51, 100, 1), 5000)
                .is_some()
        );
        assert!(s.owner(Protocol::Udp, other, 5000).is_none());
    }

    #[test]
    fn sock_diag_agrees_with_proc() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let l6 = std::net::TcpListener::bind("[::]:0").ok();
        let mut diag = diag::tcp_listeners().expect("sock_diag");
        let mut proc: Vec<HostSocket> = HostSockets::scan_proc()
            .sockets
            .into_iter()
            .filter(|s| s.protocol == Protocol::Tcp)
            .collect();
        let key = |s: &HostSocket| (s.addr, s.port, s.inode);
        diag.sort_by_key(key);
        proc.sort_by_key(key);
        // Sockets may come and go between the two reads (other tests):
        // ours are in both, with the same owner.
        let port = l.local_addr().unwrap().port();
        let find = |v: &[HostSocket], p: u16| v.iter().find(|s| s.port == p).cloned();
        assert_eq!(find(&diag, port), find(&proc, port));
        assert!(find(&diag, port).is_some());
        if let Some(l6) = l6 {
            let p6 = l6.local_addr().unwrap().port();
            assert_eq!(find(&diag, p6), find(&proc, p6));
            assert_eq!(
                find(&diag, p6).unwrap().addr,
                IpAddr::V6(Ipv6Addr::UNSPECIFIED)
            );
        }
    }

    #[test]
    fn scans_this_namespace() {
        // Whatever the machine runs, a socket we bind must show up.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let u = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        let uport = u.local_addr().unwrap().port();
        let s = HostSockets::scan();
        assert!(s.owner(Protocol::Tcp, Ipv4Addr::LOCALHOST, port).is_some());
        assert!(
            s.owner(Protocol::Udp, Ipv4Addr::new(10, 1, 2, 3), uport)
                .is_some()
        );
    }
}
