//! Value types shared by the core (`agent/`) and the rooms below it that
//! own kernel objects or allocate (`datapath/`, `netns.rs`, `alloc/`): they
//! live here so that no kernel-side room imports the core. Pure code.

use serde::{Deserialize, Serialize};

use crate::alloc::Protocol;

/// One requested port mapping; `host_port` 0 asks the agent to pick one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortMapping {
    pub protocol: Protocol,
    pub container_port: u16,
    pub host_port: u16,
    /// Bind address on the host; "" = the configured default.
    pub host_ip: String,
}

/// Which network namespace: the (device, inode) of its nsfs file, what
/// `ip netns identify` and `readlink /proc/PID/ns/net` compare. Unique
/// among live namespaces; an inode can be reused once its namespace is
/// gone (the agent then also finds the attachment's veth gone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl std::fmt::Display for NetnsId {
    /// As the kernel names it (`readlink /proc/PID/ns/net`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "net:[{}]", self.ino)
    }
}

/// A network namespace fd passed by the caller, with the namespace it
/// refers to. Two requests are equal when they name the same namespace,
/// whatever fd they carry.
#[derive(Debug, Clone)]
pub struct NetnsFd {
    pub fd: std::sync::Arc<std::os::fd::OwnedFd>,
    pub id: NetnsId,
}

impl PartialEq for NetnsFd {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for NetnsFd {}

/// Whether a policy entry is a domain pattern rather than an address or
/// CIDR (those are digits, dots and one slash).
pub fn is_domain_entry(entry: &str) -> bool {
    entry
        .bytes()
        .any(|b| !(b.is_ascii_digit() || b == b'.' || b == b'/'))
}
