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
/// CIDR (IPv4: digits, dots and one slash; IPv6: has a colon, which no
/// name has).
pub fn is_domain_entry(entry: &str) -> bool {
    !entry.contains(':')
        && entry
            .bytes()
            .any(|b| !(b.is_ascii_digit() || b == b'.' || b == b'/'))
}

/// Whether a normalised CIDR is the catch-all of either family (0.0.0.0/0,
/// ::/0). In `deny_out` it is "anything not allowed" for both families:
/// an IPv4 allow-list must not leave IPv6 open.
pub fn is_catch_all(cidr: &str) -> bool {
    cidr == "0.0.0.0/0" || cidr == "::/0"
}

/// Whether a sandbox's policy lets its IPv6 reach the world (NAT66, on a
/// node with IPv6 egress): the internet, under rules that
/// - say something about IPv6 (an IPv6 CIDR, or an allowed name, whose
///   AAAA answers are learned), or no IPv4 CIDR either: rules of IPv4
///   CIDRs only were written for IPv4 (a deny of a service's IPv4 address
///   would be bypassed by its AAAA address), so they keep the sandbox
///   IPv4-only, as before IPv6 existed;
/// - and leave some IPv6 open: not the catch-all deny (of either family)
///   with neither an IPv6 allow CIDR nor an allowed name.
///
/// Strict mode changes nothing here: its proxy takes IPv6 flows to 80 and
/// 443 as IPv4's (docs/egress.md).
pub fn ipv6_open(internet: bool, allow_out: &[String], deny_out: &[String]) -> bool {
    ipv6_closed_why(internet, allow_out, deny_out).is_none()
}

/// Why a sandbox's policy keeps its IPv6 from the world ([`ipv6_open`]
/// false), and what opens it: GetNetwork's `ipv6_egress_reason`. `None`
/// when the policy lets IPv6 out.
pub fn ipv6_closed_why(
    internet: bool,
    allow_out: &[String],
    deny_out: &[String],
) -> Option<&'static str> {
    let v6_allowed = allow_out
        .iter()
        .any(|e| e.contains(':') || is_domain_entry(e));
    let mut rules = allow_out.iter().chain(deny_out);
    let speaks_v6 = v6_allowed || deny_out.iter().any(|e| e.contains(':'));
    let v4_cidrs = rules.any(|e| !e.contains(':') && !is_domain_entry(e));
    let all_denied = deny_out.iter().any(|e| is_catch_all(e));
    if !internet {
        Some(
            "no internet access (allow_internet_access false closes both families); \
             allow it to open IPv6",
        )
    } else if v4_cidrs && !speaks_v6 {
        Some(
            "its rules are IPv4 CIDRs only, which keep a sandbox IPv4-only (a service \
             denied by its IPv4 address would be reached at its IPv6 one); add their \
             IPv6 side (an IPv6 CIDR in allow_out or deny_out, e.g. deny_out fc00::/7 \
             next to 10.0.0.0/8) or an allowed name to open IPv6 under the same rules",
        )
    } else if all_denied && !v6_allowed {
        Some(
            "deny_out has the catch-all (0.0.0.0/0 or ::/0), which closes both \
             families, and no IPv6 CIDR or name in allow_out opens IPv6 again; allow \
             IPv6 CIDRs (e.g. allow_out 2001:db8::/32) or names to open them",
        )
    } else {
        None
    }
}

/// A sandbox's bandwidth limits (docs/datapath.md "Bandwidth"): rates in
/// bits per second (0 = unlimited), bursts in bytes (0 = the default,
/// [`DEFAULT_BURST`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bandwidth {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub egress_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ingress_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub egress_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ingress_burst: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// What a sandbox idle long enough may send at once, when the caller
/// gives no burst: 64 KiB (one full-size GSO packet).
pub const DEFAULT_BURST: u64 = 64 * 1024;
/// The lowest limit (1 kB/s) and the highest (1 Tbit/s).
pub const MIN_RATE_BPS: u64 = 8_000;
pub const MAX_RATE_BPS: u64 = 1_000_000_000_000;
/// The largest burst (1 GiB).
pub const MAX_BURST: u64 = 1 << 30;

impl Bandwidth {
    pub fn is_unlimited(&self) -> bool {
        self.egress_bps == 0 && self.ingress_bps == 0
    }

    /// The burst in force for a direction (`burst` as given, 0 = default).
    pub fn burst_or_default(burst: u64) -> u64 {
        if burst == 0 { DEFAULT_BURST } else { burst }
    }

    /// Checks every field; the error names it.
    pub fn check(&self) -> Result<(), String> {
        for (key, v) in [
            ("egress_bps", self.egress_bps),
            ("ingress_bps", self.ingress_bps),
        ] {
            if v != 0 && !(MIN_RATE_BPS..=MAX_RATE_BPS).contains(&v) {
                return Err(format!(
                    "{key}: {v} bits/s is out of range {MIN_RATE_BPS}-{MAX_RATE_BPS} (0 = unlimited)"
                ));
            }
        }
        for (key, v, rate) in [
            ("egress_burst", self.egress_burst, self.egress_bps),
            ("ingress_burst", self.ingress_burst, self.ingress_bps),
        ] {
            if v > MAX_BURST {
                return Err(format!(
                    "{key}: {v} bytes is more than the largest burst, {MAX_BURST}"
                ));
            }
            if v != 0 && rate == 0 {
                return Err(format!(
                    "{key}: a burst needs a rate ({}_bps)",
                    key.trim_end_matches("_burst")
                ));
            }
        }
        Ok(())
    }
}

/// Parses a rate in bits per second: a number with an optional k, M, G or
/// T suffix (powers of 1000, as `tc` and the CNI bandwidth plugin count),
/// optionally followed by "bit" or "bps" ("100M", "1.5G", "40Mbit").
pub fn parse_rate(s: &str) -> Result<u64, String> {
    parse_scaled(s, &["bit", "bps"], 1000)
        .ok_or_else(|| format!("'{s}' is not a rate (bits/s, e.g. 40M, 1G, 500k)"))
}

/// Parses a size in bytes: a number with an optional k, M or G suffix
/// (powers of 1024), optionally followed by "B" or "iB" ("64k", "2MiB").
pub fn parse_size(s: &str) -> Result<u64, String> {
    parse_scaled(s, &["ib", "b"], 1024)
        .ok_or_else(|| format!("'{s}' is not a size (bytes, e.g. 64k, 2M)"))
}

fn parse_scaled(s: &str, units: &[&str], base: u64) -> Option<u64> {
    let t = s.trim().to_ascii_lowercase();
    let mut t = t.as_str();
    for u in units {
        if let Some(rest) = t.strip_suffix(u)
            && !rest.is_empty()
        {
            t = rest;
            break;
        }
    }
    let (num, mult) = match t.chars().last()? {
        'k' => (&t[..t.len() - 1], base),
        'm' => (&t[..t.len() - 1], base.pow(2)),
        'g' => (&t[..t.len() - 1], base.pow(3)),
        't' => (&t[..t.len() - 1], base.pow(4)),
        _ => (t, 1),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let v: f64 = num.parse().ok()?;
    let r = v * mult as f64;
    (r.is_finite() && (0.0..1.8e19).contains(&r)).then_some(r.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_sizes_parse() {
        assert_eq!(parse_rate("100M"), Ok(100_000_000));
        assert_eq!(parse_rate("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_rate("40Mbit"), Ok(40_000_000));
        assert_eq!(parse_rate("500k"), Ok(500_000));
        assert_eq!(parse_rate("8000"), Ok(8000));
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("-1M").is_err());
        assert!(parse_rate("").is_err());
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("1500"), Ok(1500));
        let b = Bandwidth {
            egress_bps: 1000,
            ..Default::default()
        };
        assert!(b.check().unwrap_err().starts_with("egress_bps: 1000"));
        let b = Bandwidth {
            ingress_burst: 10,
            ..Default::default()
        };
        assert!(b.check().unwrap_err().starts_with("ingress_burst"));
    }

    #[test]
    fn ipv6_closed_says_why_and_how_to_open() {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let why =
            |net: bool, allow: &[&str], deny: &[&str]| ipv6_closed_why(net, &v(allow), &v(deny));
        assert_eq!(why(true, &[], &[]), None);
        assert_eq!(why(true, &[], &["10.0.0.0/8", "fc00::/7"]), None);
        assert_eq!(why(true, &["*.example.com"], &["0.0.0.0/0"]), None);
        assert!(
            why(false, &[], &[])
                .unwrap()
                .contains("allow_internet_access")
        );
        let w = why(true, &[], &["10.0.0.0/8"]).unwrap();
        assert!(
            w.contains("IPv4 CIDRs only") && w.contains("fc00::/7"),
            "{w}"
        );
        let w = why(true, &["198.51.100.0/24"], &["0.0.0.0/0"]).unwrap();
        assert!(w.contains("IPv4 CIDRs only"), "{w}");
        let w = why(true, &[], &["::/0"]).unwrap();
        assert!(w.contains("catch-all"), "{w}");
        for (net, allow, deny) in [
            (true, &[][..], &["10.0.0.0/8"][..]),
            (true, &["::/0"], &["0.0.0.0/0"]),
            (false, &[], &[]),
        ] {
            assert_eq!(
                ipv6_open(net, &v(allow), &v(deny)),
                why(net, allow, deny).is_none()
            );
        }
    }
}

/// The guests' static IPv6 address, the same on every TAP and node (the
/// twin of 169.254.68.6; docs/dual-stack.md); the datapath's own copy is
/// `DP_V6_PREFIX*`/`DP_V6_GUEST_LO` in ebpf/datapath.h.
pub const GUEST_IPV6: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 6);

/// The link-local address of `mac` (modified EUI-64, RFC 4291 2.5.1).
pub fn link_local(mac: &[u8; 6]) -> std::net::Ipv6Addr {
    eui64(std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), mac)
}

/// The address SLAAC gives `mac` in the /64 of `prefix` (modified
/// EUI-64): a guest's in the guests' prefix is
/// `fd63:7562:6500:0:2290:6fff:fefc:fcfc` for the default guest MAC.
pub fn eui64(prefix: std::net::Ipv6Addr, mac: &[u8; 6]) -> std::net::Ipv6Addr {
    let w = |a: u8, b: u8| u16::from_be_bytes([a, b]);
    let p = prefix.segments();
    std::net::Ipv6Addr::new(
        p[0],
        p[1],
        p[2],
        p[3],
        w(mac[0] ^ 2, mac[1]),
        w(mac[2], 0xff),
        w(0xfe, mac[3]),
        w(mac[4], mac[5]),
    )
}

#[cfg(test)]
mod ipv6_tests {
    #[test]
    fn the_gateway_macs_link_local_address() {
        assert_eq!(
            super::link_local(&[0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf]).to_string(),
            "fe80::2290:6fff:fecf:cfcf"
        );
    }

    #[test]
    fn the_guest_macs_slaac_address() {
        assert_eq!(
            super::eui64(super::GUEST_IPV6, &[0x20, 0x90, 0x6f, 0xfc, 0xfc, 0xfc]).to_string(),
            "fd63:7562:6500:0:2290:6fff:fefc:fcfc"
        );
    }
}
