//! Bitmap allocator for sandbox IPv4 addresses, and the CIDR types.
//!
//! The network address, the first host address (the gateway on `cube-dev`)
//! and the broadcast address are reserved. Allocation is round-robin: the
//! search starts after the last address handed out, so a freed address is
//! not reused until the cursor has gone round the whole pool.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An IPv4 network in CIDR notation with no host bits set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix_len: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("'{0}' is not in CIDR form ADDRESS/PREFIX")]
    Form(String),
    #[error("'{0}' has an invalid IPv4 address")]
    Address(String),
    #[error("'{0}' has an invalid prefix length (0-32)")]
    Prefix(String),
    #[error("'{0}' has an invalid IPv6 address")]
    Address6(String),
    #[error("'{0}' has an invalid prefix length (0-128)")]
    Prefix6(String),
    #[error("'{given}' has host bits set; did you mean {suggested}?")]
    HostBits { given: String, suggested: String },
}

impl Ipv4Cidr {
    pub fn new(network: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        if prefix_len > 32 || u32::from(network) & !mask(prefix_len) != 0 {
            return None;
        }
        Some(Self {
            network,
            prefix_len,
        })
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// Number of addresses in the network (2^(32-prefix)).
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix_len))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix_len) == u32::from(self.network)
    }

    /// The `n`-th address of the network (0 = network address).
    pub fn nth(&self, n: u32) -> Option<Ipv4Addr> {
        (u64::from(n) < self.size()).then(|| Ipv4Addr::from(u32::from(self.network) + n))
    }

    /// The first host address, used as the gateway address on `cube-dev`.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network).wrapping_add(1))
    }

    fn offset(&self, ip: Ipv4Addr) -> Option<u32> {
        self.contains(ip)
            .then(|| u32::from(ip) - u32::from(self.network))
    }
}

fn mask(prefix_len: u8) -> u32 {
    if prefix_len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix_len))
    }
}

impl FromStr for Ipv4Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, len) = s.split_once('/').ok_or_else(|| CidrError::Form(s.into()))?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| CidrError::Address(s.into()))?;
        let len: u8 = len
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .ok_or_else(|| CidrError::Prefix(s.into()))?;
        Self::new(addr, len).ok_or_else(|| CidrError::HostBits {
            given: s.into(),
            suggested: format!("{}/{len}", Ipv4Addr::from(u32::from(addr) & mask(len))),
        })
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

/// What code that handles CIDRs of either family needs of one.
pub trait Cidr: FromStr<Err = CidrError> + Copy + PartialEq + fmt::Display {
    type Addr: FromStr;
    /// An address's length in bits (32, 128).
    const BITS: u8;
    /// `None` when `network` has host bits set.
    fn new(network: Self::Addr, prefix_len: u8) -> Option<Self>;
    fn prefix_len(&self) -> u8;
    /// Every address of the family (0.0.0.0/0, ::/0).
    fn all() -> Self;
}

impl Cidr for Ipv4Cidr {
    type Addr = Ipv4Addr;
    const BITS: u8 = 32;
    fn new(network: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        Ipv4Cidr::new(network, prefix_len)
    }
    fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    fn all() -> Self {
        Ipv4Cidr::new(Ipv4Addr::UNSPECIFIED, 0).expect("/0 has no host bits")
    }
}

impl Cidr for Ipv6Cidr {
    type Addr = Ipv6Addr;
    const BITS: u8 = 128;
    fn new(network: Ipv6Addr, prefix_len: u8) -> Option<Self> {
        Ipv6Cidr::new(network, prefix_len)
    }
    fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    fn all() -> Self {
        Ipv6Cidr::new(Ipv6Addr::UNSPECIFIED, 0).expect("/0 has no host bits")
    }
}

/// An IPv6 network in CIDR notation with no host bits set (the rules'
/// IPv6 CIDRs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Cidr {
    network: Ipv6Addr,
    prefix_len: u8,
}

fn mask6(prefix_len: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(prefix_len))
        .unwrap_or(0)
}

impl Ipv6Cidr {
    pub fn new(network: Ipv6Addr, prefix_len: u8) -> Option<Self> {
        if prefix_len > 128 || u128::from(network) & !mask6(prefix_len) != 0 {
            return None;
        }
        Some(Self {
            network,
            prefix_len,
        })
    }

    pub fn network(&self) -> Ipv6Addr {
        self.network
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    pub fn contains(&self, ip: Ipv6Addr) -> bool {
        u128::from(ip) & mask6(self.prefix_len) == u128::from(self.network)
    }
}

impl FromStr for Ipv6Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, len) = s.split_once('/').ok_or_else(|| CidrError::Form(s.into()))?;
        let addr: Ipv6Addr = addr.parse().map_err(|_| CidrError::Address6(s.into()))?;
        let len: u8 = len
            .parse()
            .ok()
            .filter(|l| *l <= 128)
            .ok_or_else(|| CidrError::Prefix6(s.into()))?;
        Self::new(addr, len).ok_or_else(|| CidrError::HostBits {
            given: s.into(),
            suggested: format!("{}/{len}", Ipv6Addr::from(u128::from(addr) & mask6(len))),
        })
    }
}

impl fmt::Display for Ipv6Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    #[error("address is outside the pool")]
    OutOfPool,
    #[error("address is reserved (network, gateway or broadcast)")]
    Reserved,
    #[error("address is already allocated")]
    Taken,
}

/// Round-robin bitmap allocator over one IPv4 pool.
#[derive(Debug, Clone)]
pub struct IpAllocator {
    cidr: Ipv4Cidr,
    /// One bit per address of the pool; set = in use or reserved.
    bits: Vec<u64>,
    /// Offset at which the next search starts.
    cursor: u32,
    free: u32,
    capacity: u32,
}

impl IpAllocator {
    /// Smallest pool that still has one usable address: /30.
    pub const MAX_PREFIX_LEN: u8 = 30;

    pub fn new(cidr: Ipv4Cidr) -> Option<Self> {
        if cidr.prefix_len() > Self::MAX_PREFIX_LEN {
            return None;
        }
        let size = cidr.size();
        let words = size.div_ceil(64) as usize;
        let mut alloc = Self {
            cidr,
            bits: vec![0; words],
            cursor: 2,
            free: 0,
            capacity: (size - 3) as u32,
        };
        for reserved in [0, 1, (size - 1) as u32] {
            alloc.set(reserved);
        }
        alloc.free = alloc.capacity;
        Some(alloc)
    }

    pub fn cidr(&self) -> Ipv4Cidr {
        self.cidr
    }

    /// Usable addresses (pool size minus network, gateway and broadcast).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn free(&self) -> u32 {
        self.free
    }

    fn is_set(&self, off: u32) -> bool {
        self.bits[(off / 64) as usize] & (1 << (off % 64)) != 0
    }

    fn set(&mut self, off: u32) {
        self.bits[(off / 64) as usize] |= 1 << (off % 64);
    }

    fn clear(&mut self, off: u32) {
        self.bits[(off / 64) as usize] &= !(1 << (off % 64));
    }

    fn is_reserved(&self, off: u32) -> bool {
        off <= 1 || u64::from(off) == self.cidr.size() - 1
    }

    /// Hands out the next free address after the cursor, or `None` when the
    /// pool is exhausted.
    pub fn allocate(&mut self) -> Option<Ipv4Addr> {
        if self.free == 0 {
            return None;
        }
        let size = self.cidr.size() as u32;
        let off = self
            .find_clear(self.cursor, size)
            .or_else(|| self.find_clear(0, self.cursor))?;
        self.set(off);
        self.free -= 1;
        self.cursor = if off + 1 >= size { 0 } else { off + 1 };
        self.cidr.nth(off)
    }

    /// First clear bit in `[from, to)`, scanning whole words at a time.
    fn find_clear(&self, from: u32, to: u32) -> Option<u32> {
        let mut off = from;
        while off < to {
            let word = self.bits[(off / 64) as usize] | ((1u64 << (off % 64)) - 1);
            if word != u64::MAX {
                let found = (off / 64) * 64 + word.trailing_ones();
                return (found < to).then_some(found);
            }
            off = (off / 64 + 1) * 64;
        }
        None
    }

    /// Marks a specific address as in use (recovery of persisted records).
    pub fn reserve(&mut self, ip: Ipv4Addr) -> Result<(), ReserveError> {
        let off = self.cidr.offset(ip).ok_or(ReserveError::OutOfPool)?;
        if self.is_reserved(off) {
            return Err(ReserveError::Reserved);
        }
        if self.is_set(off) {
            return Err(ReserveError::Taken);
        }
        self.set(off);
        self.free -= 1;
        Ok(())
    }

    /// Returns an address to the pool. Returns false if it was not allocated.
    pub fn release(&mut self, ip: Ipv4Addr) -> bool {
        match self.cidr.offset(ip) {
            Some(off) if !self.is_reserved(off) && self.is_set(off) => {
                self.clear(off);
                self.free += 1;
                true
            }
            _ => false,
        }
    }

    /// Continues round-robin after `ip` (used after recovery so freshly
    /// freed addresses are not handed out first).
    pub fn set_cursor_after(&mut self, ip: Ipv4Addr) {
        if let Some(off) = self.cidr.offset(ip) {
            let size = self.cidr.size() as u32;
            self.cursor = if off + 1 >= size { 0 } else { off + 1 };
        }
    }

    pub fn is_allocated(&self, ip: Ipv4Addr) -> bool {
        self.cidr
            .offset(ip)
            .is_some_and(|off| !self.is_reserved(off) && self.is_set(off))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Ipv4Cidr {
        s.parse().unwrap()
    }

    #[test]
    fn parse_cidr() {
        let c = cidr("192.168.0.0/18");
        assert_eq!(c.network(), Ipv4Addr::new(192, 168, 0, 0));
        assert_eq!(c.prefix_len(), 18);
        assert_eq!(c.size(), 16384);
        assert_eq!(c.gateway(), Ipv4Addr::new(192, 168, 0, 1));
        assert_eq!(c.to_string(), "192.168.0.0/18");
        assert!(c.contains(Ipv4Addr::new(192, 168, 63, 255)));
        assert!(!c.contains(Ipv4Addr::new(192, 168, 64, 0)));
    }

    #[test]
    fn parse_cidr_errors_are_specific() {
        assert_eq!(
            "192.168.0.1/18".parse::<Ipv4Cidr>(),
            Err(CidrError::HostBits {
                given: "192.168.0.1/18".into(),
                suggested: "192.168.0.0/18".into()
            })
        );
        assert!(matches!(
            "10.0.0.0".parse::<Ipv4Cidr>(),
            Err(CidrError::Form(_))
        ));
        assert!(matches!(
            "10.0.0/8".parse::<Ipv4Cidr>(),
            Err(CidrError::Address(_))
        ));
        assert!(matches!(
            "10.0.0.0/33".parse::<Ipv4Cidr>(),
            Err(CidrError::Prefix(_))
        ));
        assert!(matches!(
            "10.0.0.0/x".parse::<Ipv4Cidr>(),
            Err(CidrError::Prefix(_))
        ));
        let msg = "192.168.0.1/18"
            .parse::<Ipv4Cidr>()
            .unwrap_err()
            .to_string();
        assert!(msg.contains("192.168.0.0/18"), "{msg}");
    }

    #[test]
    fn reserves_network_gateway_broadcast() {
        let mut a = IpAllocator::new(cidr("10.0.0.0/29")).unwrap();
        assert_eq!(a.capacity(), 5);
        let got: Vec<_> = std::iter::from_fn(|| a.allocate()).collect();
        let want: Vec<_> = (2..=6).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect();
        assert_eq!(got, want);
        assert_eq!(a.free(), 0);
        assert_eq!(a.allocate(), None);
        assert_eq!(
            a.reserve(Ipv4Addr::new(10, 0, 0, 0)),
            Err(ReserveError::Reserved)
        );
        assert_eq!(
            a.reserve(Ipv4Addr::new(10, 0, 0, 1)),
            Err(ReserveError::Reserved)
        );
        assert_eq!(
            a.reserve(Ipv4Addr::new(10, 0, 0, 7)),
            Err(ReserveError::Reserved)
        );
        assert_eq!(
            a.reserve(Ipv4Addr::new(10, 0, 0, 8)),
            Err(ReserveError::OutOfPool)
        );
        assert!(!a.release(Ipv4Addr::new(10, 0, 0, 1)));
    }

    #[test]
    fn smallest_and_too_small_pools() {
        let mut a = IpAllocator::new(cidr("10.0.0.4/30")).unwrap();
        assert_eq!(a.allocate(), Some(Ipv4Addr::new(10, 0, 0, 6)));
        assert_eq!(a.allocate(), None);
        assert!(IpAllocator::new(cidr("10.0.0.4/31")).is_none());
        assert!(IpAllocator::new(cidr("10.0.0.4/32")).is_none());
    }

    #[test]
    fn round_robin_does_not_reuse_freed_address_at_once() {
        let mut a = IpAllocator::new(cidr("10.0.0.0/28")).unwrap();
        let first = a.allocate().unwrap();
        let second = a.allocate().unwrap();
        assert!(a.release(first));
        let third = a.allocate().unwrap();
        assert_ne!(third, first);
        assert_ne!(third, second);
        // Exhaust the rest; the freed address comes back only at wrap-around.
        let mut rest = vec![];
        while let Some(ip) = a.allocate() {
            rest.push(ip);
        }
        assert_eq!(rest.last(), Some(&first));
        assert_eq!(a.free(), 0);
    }

    #[test]
    fn reserve_then_release_roundtrip() {
        let mut a = IpAllocator::new(cidr("192.168.0.0/18")).unwrap();
        let ip = Ipv4Addr::new(192, 168, 10, 7);
        a.reserve(ip).unwrap();
        assert_eq!(a.reserve(ip), Err(ReserveError::Taken));
        assert!(a.is_allocated(ip));
        assert_eq!(a.free(), a.capacity() - 1);
        assert!(a.release(ip));
        assert!(!a.release(ip));
        assert_eq!(a.free(), a.capacity());
    }

    #[test]
    fn full_pool_allocates_every_address_once() {
        let mut a = IpAllocator::new(cidr("10.1.0.0/18")).unwrap();
        let mut seen = std::collections::HashSet::new();
        while let Some(ip) = a.allocate() {
            assert!(seen.insert(ip), "duplicate {ip}");
        }
        assert_eq!(seen.len() as u32, a.capacity());
        assert_eq!(seen.len(), 16384 - 3);
    }

    #[test]
    fn cursor_after_recovery() {
        let mut a = IpAllocator::new(cidr("10.0.0.0/24")).unwrap();
        a.reserve(Ipv4Addr::new(10, 0, 0, 50)).unwrap();
        a.set_cursor_after(Ipv4Addr::new(10, 0, 0, 50));
        assert_eq!(a.allocate(), Some(Ipv4Addr::new(10, 0, 0, 51)));
    }

    #[test]
    fn wraps_at_end_of_pool() {
        let mut a = IpAllocator::new(cidr("10.0.0.0/29")).unwrap();
        a.set_cursor_after(Ipv4Addr::new(10, 0, 0, 6));
        assert_eq!(a.allocate(), Some(Ipv4Addr::new(10, 0, 0, 2)));
    }

    #[test]
    fn parse_ipv6_cidr() {
        let c: Ipv6Cidr = "2001:db8::/32".parse().unwrap();
        assert_eq!(c.prefix_len(), 32);
        assert!(c.contains("2001:db8:ffff::1".parse().unwrap()));
        assert!(!c.contains("2001:db9::1".parse().unwrap()));
        let all: Ipv6Cidr = "::/0".parse().unwrap();
        assert!(all.contains("fd00:ec2::254".parse().unwrap()));
        let one: Ipv6Cidr = "2001:db8::1/128".parse().unwrap();
        assert!(one.contains("2001:db8::1".parse().unwrap()));
        assert!(!one.contains("2001:db8::2".parse().unwrap()));
        let e = "2001:db8::1/32"
            .parse::<Ipv6Cidr>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean 2001:db8::/32"), "{e}");
        let e = "2001:db8::/129"
            .parse::<Ipv6Cidr>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("0-128"), "{e}");
        let e = "2001:zz8::/32".parse::<Ipv6Cidr>().unwrap_err().to_string();
        assert!(e.contains("invalid IPv6 address"), "{e}");
        assert_eq!(c.to_string(), "2001:db8::/32");
    }
}
