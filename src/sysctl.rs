//! Every host sysctl the agent writes, in one place (the unit's
//! `ReadWritePaths=` lists exactly these under `ProtectKernelTunables=`):
//! - `net.ipv6.conf.<tap>.disable_ipv6 = 1` on each TAP it creates: guests
//!   are IPv4-only, and IPv6 addrconf on thousands of TAPs makes every
//!   link-up O(number of TAPs) under RTNL;
//! - `net.ipv4.conf.lo.route_localnet = 1` and `accept_local = 1`: replies
//!   to the host's own connections to 127.x:host_port are redirected into
//!   lo as fresh packets, which the kernel would otherwise drop as martian
//!   (docs/datapath.md). Only lo is changed: what arrives on lo is local.

/// Disables IPv6 on a TAP the agent created; failure (no IPv6 in the
/// kernel) is not an error.
pub fn disable_ipv6(tap: &str) -> std::io::Result<()> {
    std::fs::write(format!("/proc/sys/net/ipv6/conf/{tap}/disable_ipv6"), "1")
}

const LOOPBACK_LOCALNET: [&str; 2] = [
    "/proc/sys/net/ipv4/conf/lo/route_localnet",
    "/proc/sys/net/ipv4/conf/lo/accept_local",
];

/// Lets host -> 127.x:host_port port mappings work; the first write that
/// failed, with its path, otherwise.
pub fn enable_loopback_localnet() -> Result<(), String> {
    LOOPBACK_LOCALNET.iter().try_for_each(|path| {
        std::fs::write(path, "1").map_err(|e| format!("cannot set {path}: {e}"))
    })
}
