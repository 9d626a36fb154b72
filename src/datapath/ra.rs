//! Router Advertisements the agent sends itself (docs/dual-stack.md): the
//! RA `guest_ipv6` answers a Router Solicitation with, unsolicited — when
//! the node's IPv6 egress comes or goes (a guest learns it at once rather
//! than at its next solicitation, which a running Linux guest never sends),
//! and every [`RA_INTERVAL`], so a guest that ignores the Route Information
//! option keeps the default route its router lifetime bounds.

use std::io;
use std::net::Ipv6Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// How often every sandbox gets an RA (RFC 4861's default
/// MaxRtrAdvInterval); the router lifetime (9000 s) outlasts many.
pub const RA_INTERVAL: Duration = Duration::from_secs(600);

/// The router lifetime of an RA with the default route (the largest RFC
/// 4861 allows).
const ROUTER_LIFETIME: u16 = 9000;
const ETH_P_IPV6: u16 = 0x86dd;
const ICMPV6: u8 = 58;
const ND_ROUTER_ADVERT: u8 = 134;
/// The guests' prefix (`fd63:7562:6500::/64`, ebpf/datapath.h).
const PREFIX: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 0);
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
/// The gateway's address in the guests' prefix, where the agent's
/// resolver answers over IPv6 (the twin of 169.254.68.5).
pub const RESOLVER: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 5);

/// The RA frame for one sandbox, byte for byte the one `guest_ipv6`
/// builds: Ethernet from the gateway MAC to the guest MAC, from the
/// gateway's link-local address to all nodes, hop limit 255; the source
/// link-layer address, the prefix (on-link, autonomous, infinite), and a
/// Route Information option for ::/0. `router`: the sandbox's IPv6 reaches
/// the world, so the RA carries the default route (router lifetime 9000 s,
/// route lifetime infinite); else both lifetimes are 0, which withdraws a
/// default route an earlier RA gave. `resolver`: the node reaches its
/// sandboxes over IPv6 (`ipv6_pool` routed), so the agent's resolver
/// answers at the gateway's `fd63:7562:6500::5` and the RA names it
/// (RDNSS, RFC 8106, infinite); else the option says no server (lifetime 0).
pub fn frame(gateway_mac: [u8; 6], guest_mac: [u8; 6], router: bool, resolver: bool) -> Vec<u8> {
    let src = crate::types::link_local(&gateway_mac);
    let mut ra = Vec::with_capacity(88);
    ra.extend_from_slice(&[ND_ROUTER_ADVERT, 0, 0, 0, 64, 0]);
    let lifetime = if router { ROUTER_LIFETIME } else { 0 };
    ra.extend_from_slice(&lifetime.to_be_bytes());
    ra.extend_from_slice(&[0; 8]); // reachable, retrans
    ra.extend_from_slice(&[1, 1]);
    ra.extend_from_slice(&gateway_mac);
    ra.extend_from_slice(&[3, 4, 64, 0xc0]);
    ra.extend_from_slice(&[0xff; 8]); // valid, preferred: infinite
    ra.extend_from_slice(&[0; 4]);
    ra.extend_from_slice(&PREFIX.octets());
    ra.extend_from_slice(&[24, 1, 0, 0]);
    let route = if router { u32::MAX } else { 0 };
    ra.extend_from_slice(&route.to_be_bytes());
    ra.extend_from_slice(&[25, 3, 0, 0]);
    let dns = if resolver { u32::MAX } else { 0 };
    ra.extend_from_slice(&dns.to_be_bytes());
    ra.extend_from_slice(&RESOLVER.octets());
    let sum = checksum(&src, &ALL_NODES, &ra);
    ra[2..4].copy_from_slice(&sum.to_be_bytes());

    let mut f = Vec::with_capacity(14 + 40 + ra.len());
    f.extend_from_slice(&guest_mac);
    f.extend_from_slice(&gateway_mac);
    f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
    f.extend_from_slice(&0x6000_0000u32.to_be_bytes());
    f.extend_from_slice(&(ra.len() as u16).to_be_bytes());
    f.extend_from_slice(&[ICMPV6, 255]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&ALL_NODES.octets());
    f.extend_from_slice(&ra);
    f
}

/// The ICMPv6 checksum of `msg` (its checksum field 0) from `src` to `dst`.
fn checksum(src: &Ipv6Addr, dst: &Ipv6Addr, msg: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for w in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&(msg.len() as u32).to_be_bytes());
    add(&[0, 0, 0, ICMPV6]);
    add(msg);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A packet socket that sends whole frames out of a device (to whatever
/// is on its far side: the guest) and receives nothing.
pub struct Sender(OwnedFd);

impl Sender {
    pub fn new() -> io::Result<Self> {
        // SAFETY: socket(2) with constant arguments; protocol 0 binds no
        // protocol, so the socket receives nothing.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by no
        // one else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Sends `frame` (Ethernet header included) out of device `ifindex`,
    /// without waiting (a full socket buffer is an error, the RA is
    /// repeated within RA_INTERVAL).
    pub fn send(&self, ifindex: u32, frame: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = ETH_P_IPV6.to_be();
        to.sll_ifindex = ifindex as i32;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: sendto(2) on our socket with a buffer of `frame.len()`
        // bytes and a sockaddr_ll of its size, both alive for the call.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                // Never waits: a converge (put_view) sends one of these.
                libc::MSG_DONTWAIT,
                (&raw const to).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ra_with_and_without_the_default_route() {
        let gw = [0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf];
        let guest = [0x20, 0x90, 0x6f, 0xfc, 0xfc, 0xfc];
        let f = frame(gw, guest, true, true);
        assert_eq!(f.len(), 14 + 40 + 88);
        assert_eq!(&f[..6], &guest);
        assert_eq!(&f[6..12], &gw);
        let (ip, ra) = (&f[14..54], &f[54..]);
        assert_eq!(&ip[8..24], &crate::types::link_local(&gw).octets());
        assert_eq!(ra[0], ND_ROUTER_ADVERT);
        assert_eq!(u16::from_be_bytes([ra[6], ra[7]]), 9000);
        assert_eq!(&ra[60..64], &[0xff; 4]);
        // RDNSS: type 25, 3 units of 8 bytes, infinite, the resolver.
        assert_eq!(&ra[64..68], &[25, 3, 0, 0]);
        assert_eq!(&ra[68..72], &[0xff; 4]);
        assert_eq!(&ra[72..88], &RESOLVER.octets());
        // The checksum of the whole message with its checksum is 0.
        let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
        assert_eq!(checksum(&src, &ALL_NODES, ra), 0);
        let f = frame(gw, guest, false, false);
        let ra = &f[54..];
        assert_eq!(u16::from_be_bytes([ra[6], ra[7]]), 0);
        assert_eq!(&ra[60..64], &[0; 4]);
        assert_eq!(&ra[68..72], &[0; 4]);
        assert_eq!(checksum(&src, &ALL_NODES, ra), 0);
    }
}
