//! Host-port allocator for port mappings.
//!
//! Automatic allocation draws round-robin from a configured range
//! (`host_port_range`, like `ip_local_port_range`) and skips an exclusion
//! list (`reserved_host_ports`, the same syntax as
//! `ip_local_reserved_ports`, merged with the kernel's own list). Explicit
//! host ports may be any port 1-65535 (as with `bind`, the exclusions only
//! steer automatic choice) but fail when another sandbox holds them.
//! TCP and UDP are separate spaces.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    fn index(self) -> usize {
        match self {
            Protocol::Tcp => 0,
            Protocol::Udp => 1,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Protocol {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "tcp" => Ok(Protocol::Tcp),
            "udp" => Ok(Protocol::Udp),
            _ => Err(()),
        }
    }
}

/// A set of ports, one bit each.
#[derive(Clone, PartialEq, Eq)]
pub struct PortSet(Box<[u64; 1024]>);

impl Default for PortSet {
    fn default() -> Self {
        Self(Box::new([0; 1024]))
    }
}

impl fmt::Debug for PortSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PortSet({} ports)", self.len())
    }
}

impl PortSet {
    pub fn contains(&self, port: u16) -> bool {
        self.0[usize::from(port / 64)] & (1 << (port % 64)) != 0
    }

    pub fn insert(&mut self, port: u16) -> bool {
        let had = self.contains(port);
        self.0[usize::from(port / 64)] |= 1 << (port % 64);
        !had
    }

    pub fn remove(&mut self, port: u16) -> bool {
        let had = self.contains(port);
        self.0[usize::from(port / 64)] &= !(1 << (port % 64));
        had
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    pub fn extend(&mut self, other: &PortSet) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a |= *b;
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{input}': {why}")]
pub struct PortListError {
    input: String,
    why: String,
}

impl FromStr for PortSet {
    type Err = PortListError;

    /// Parses the kernel's `ip_local_reserved_ports` syntax: `"80,443,8000-8100"`
    /// (empty string = no ports).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why: String| PortListError {
            input: s.into(),
            why,
        };
        let mut set = PortSet::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (lo, hi) = match item.split_once('-') {
                Some((lo, hi)) => (parse_port(lo, &err)?, parse_port(hi, &err)?),
                None => {
                    let p = parse_port(item, &err)?;
                    (p, p)
                }
            };
            if lo > hi {
                return Err(err(format!("range {item} is reversed")));
            }
            for p in lo..=hi {
                set.insert(p);
            }
        }
        Ok(set)
    }
}

fn parse_port(s: &str, err: &dyn Fn(String) -> PortListError) -> Result<u16, PortListError> {
    s.trim()
        .parse::<u16>()
        .map_err(|_| err(format!("'{s}' is not a port number (0-65535)")))
}

/// Parses `"LOW-HIGH"` (inclusive) as in `ip_local_port_range`, which also
/// accepts whitespace: `"32768\t60999"`.
pub fn parse_range(s: &str) -> Result<(u16, u16), PortListError> {
    let err = |why: &str| PortListError {
        input: s.into(),
        why: why.into(),
    };
    let parts: Vec<&str> = s
        .split(|c: char| c == '-' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .collect();
    let [lo, hi] = parts[..] else {
        return Err(err("expected LOW-HIGH"));
    };
    let lo: u16 = lo.parse().map_err(|_| err("LOW is not a port number"))?;
    let hi: u16 = hi.parse().map_err(|_| err("HIGH is not a port number"))?;
    if lo == 0 || lo > hi {
        return Err(err("need 1 <= LOW <= HIGH"));
    }
    Ok((lo, hi))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    #[error("no free {0} host port left in the range")]
    Exhausted(Protocol),
    #[error("{0} host port {1} is already mapped by another sandbox")]
    InUse(Protocol, u16),
    #[error("host port 0 cannot be reserved")]
    Zero,
}

#[derive(Debug, Clone)]
pub struct PortAllocator {
    low: u16,
    high: u16,
    excluded: PortSet,
    used: [PortSet; 2],
    cursor: [u16; 2],
    /// Free ports inside the range, per protocol.
    free: [u32; 2],
}

impl PortAllocator {
    pub fn new(low: u16, high: u16, excluded: PortSet) -> Self {
        let in_range = (low..=high).filter(|p| !excluded.contains(*p)).count() as u32;
        Self {
            low,
            high,
            excluded,
            used: [PortSet::default(), PortSet::default()],
            cursor: [low, low],
            free: [in_range, in_range],
        }
    }

    fn allocatable(&self, port: u16) -> bool {
        (self.low..=self.high).contains(&port) && !self.excluded.contains(port)
    }

    /// Picks the next free port of the range after the cursor.
    pub fn allocate(&mut self, proto: Protocol) -> Result<u16, PortError> {
        let i = proto.index();
        if self.free[i] == 0 {
            return Err(PortError::Exhausted(proto));
        }
        let span = u32::from(self.high - self.low) + 1;
        let start = u32::from(self.cursor[i] - self.low);
        for step in 0..span {
            let port = self.low + ((start + step) % span) as u16;
            if self.allocatable(port) && !self.used[i].contains(port) {
                self.used[i].insert(port);
                self.free[i] -= 1;
                self.cursor[i] = if port == self.high {
                    self.low
                } else {
                    port + 1
                };
                return Ok(port);
            }
        }
        Err(PortError::Exhausted(proto))
    }

    /// Claims an explicit host port.
    pub fn reserve(&mut self, proto: Protocol, port: u16) -> Result<(), PortError> {
        if port == 0 {
            return Err(PortError::Zero);
        }
        let i = proto.index();
        if !self.used[i].insert(port) {
            return Err(PortError::InUse(proto, port));
        }
        if self.allocatable(port) {
            self.free[i] -= 1;
        }
        Ok(())
    }

    pub fn release(&mut self, proto: Protocol, port: u16) -> bool {
        let i = proto.index();
        let had = self.used[i].remove(port);
        if had && self.allocatable(port) {
            self.free[i] += 1;
        }
        had
    }

    pub fn is_used(&self, proto: Protocol, port: u16) -> bool {
        self.used[proto.index()].contains(port)
    }

    pub fn free(&self, proto: Protocol) -> u32 {
        self.free[proto.index()]
    }

    pub fn used_count(&self, proto: Protocol) -> usize {
        self.used[proto.index()].len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_reserved_ports_syntax() {
        let s: PortSet = "80, 443,8000-8002".parse().unwrap();
        assert_eq!(s.len(), 5);
        assert!(s.contains(80) && s.contains(8001) && !s.contains(8003));
        assert!("".parse::<PortSet>().unwrap().is_empty());
        assert!("\n".parse::<PortSet>().unwrap().is_empty());
        let e = "80,9-1".parse::<PortSet>().unwrap_err().to_string();
        assert!(e.contains("reversed"), "{e}");
        let e = "80,http".parse::<PortSet>().unwrap_err().to_string();
        assert!(e.contains("'http'"), "{e}");
        assert!("70000".parse::<PortSet>().is_err());
    }

    #[test]
    fn parses_ranges() {
        assert_eq!(parse_range("20000-29999"), Ok((20000, 29999)));
        assert_eq!(parse_range("32768\t60999\n"), Ok((32768, 60999)));
        assert!(parse_range("5-1").is_err());
        assert!(parse_range("0-10").is_err());
        assert!(parse_range("10").is_err());
        assert!(parse_range("1-2-3").is_err());
    }

    #[test]
    fn allocates_round_robin_skipping_exclusions() {
        let mut a = PortAllocator::new(100, 105, "101,103-104".parse().unwrap());
        assert_eq!(a.free(Protocol::Tcp), 3);
        assert_eq!(a.allocate(Protocol::Tcp), Ok(100));
        assert_eq!(a.allocate(Protocol::Tcp), Ok(102));
        assert!(a.release(Protocol::Tcp, 100));
        assert_eq!(a.allocate(Protocol::Tcp), Ok(105));
        assert_eq!(a.allocate(Protocol::Tcp), Ok(100));
        assert_eq!(
            a.allocate(Protocol::Tcp),
            Err(PortError::Exhausted(Protocol::Tcp))
        );
        // UDP is an independent space.
        assert_eq!(a.allocate(Protocol::Udp), Ok(100));
    }

    #[test]
    fn explicit_ports_conflict_and_count() {
        let mut a = PortAllocator::new(100, 101, PortSet::default());
        a.reserve(Protocol::Tcp, 8080).unwrap();
        assert_eq!(
            a.reserve(Protocol::Tcp, 8080),
            Err(PortError::InUse(Protocol::Tcp, 8080))
        );
        a.reserve(Protocol::Udp, 8080).unwrap();
        // An explicit port inside the range takes it away from allocation.
        a.reserve(Protocol::Tcp, 100).unwrap();
        assert_eq!(a.free(Protocol::Tcp), 1);
        assert_eq!(a.allocate(Protocol::Tcp), Ok(101));
        assert_eq!(
            a.allocate(Protocol::Tcp),
            Err(PortError::Exhausted(Protocol::Tcp))
        );
        assert!(a.release(Protocol::Tcp, 8080));
        assert!(!a.release(Protocol::Tcp, 8080));
        assert_eq!(a.free(Protocol::Tcp), 0);
        assert!(a.release(Protocol::Tcp, 100));
        assert_eq!(a.free(Protocol::Tcp), 1);
        assert_eq!(a.reserve(Protocol::Tcp, 0), Err(PortError::Zero));
    }

    #[test]
    fn excluded_port_may_still_be_requested_explicitly() {
        let mut a = PortAllocator::new(100, 102, "101".parse().unwrap());
        a.reserve(Protocol::Tcp, 101).unwrap();
        assert_eq!(a.free(Protocol::Tcp), 2);
        assert!(a.release(Protocol::Tcp, 101));
        assert_eq!(a.free(Protocol::Tcp), 2);
    }

    #[test]
    fn every_port_once_in_full_range() {
        let mut a = PortAllocator::new(1, 65535, PortSet::default());
        let mut n = 0;
        while a.allocate(Protocol::Udp).is_ok() {
            n += 1;
        }
        assert_eq!(n, 65535);
        assert_eq!(a.used_count(Protocol::Udp), 65535);
    }
}
