//! Pure allocators: sandbox addresses from the pool CIDR and host ports for
//! port mappings. No syscalls here; the agent holds these behind a short lock.

pub mod ip;
pub mod port;

pub use ip::{IpAllocator, Ipv4Cidr};
pub use port::{PortAllocator, PortSet, Protocol};
