//! Pure allocators: sandbox addresses from the pool CIDR, host ports for
//! port mappings and the rules a mapping's host port must pass. No syscalls
//! here; the agent holds these behind a short lock.

pub mod ip;
pub mod mapping;
pub mod port;

pub use ip::{IpAllocator, Ipv4Cidr, Ipv6Cidr};
pub use port::{PortAllocator, PortSet, Protocol};
