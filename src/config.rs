//! Configuration: `/etc/cube-network-agent/config.toml` (every key optional),
//! overridden by command-line flags. All defaults live in [`Config::default`].

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::alloc::port::{PortSet, parse_range};
use crate::alloc::{IpAllocator, Ipv4Cidr};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/cube-network-agent/config.toml";
/// Longest TAP prefix: the prefix plus 8 hex digits must fit IFNAMSIZ-1.
pub const MAX_TAP_PREFIX: usize = 7;
pub const MIN_MTU: u32 = 576;
pub const MAX_MTU: u32 = 9000;

/// Which bus to serve on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum BusChoice {
    System,
    Session,
    Address(String),
}

impl From<BusChoice> for String {
    fn from(b: BusChoice) -> String {
        match b {
            BusChoice::System => "system".into(),
            BusChoice::Session => "session".into(),
            BusChoice::Address(a) => a,
        }
    }
}

impl TryFrom<String> for BusChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "system" => Ok(BusChoice::System),
            "session" => Ok(BusChoice::Session),
            a if a.contains(':') => Ok(BusChoice::Address(a.into())),
            _ => Err(format!(
                "'{s}' is not 'system', 'session' or a D-Bus address like unix:path=/run/bus"
            )),
        }
    }
}

/// Whether guests get an IPv6 link (docs/dual-stack.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(into = "String", try_from = "String")]
pub enum Ipv6Mode {
    /// The guests' IPv6 link: Router Advertisements with the fixed
    /// on-link prefix, the gateway's addresses, and an immediate RST or
    /// ICMPv6 unreachable for anything sent off the link (there is no
    /// IPv6 egress yet).
    #[default]
    Auto,
    /// Every IPv6 frame from a guest is dropped (the builds before).
    Off,
}

impl From<Ipv6Mode> for String {
    fn from(m: Ipv6Mode) -> String {
        match m {
            Ipv6Mode::Auto => "auto".into(),
            Ipv6Mode::Off => "off".into(),
        }
    }
}

impl TryFrom<&str> for Ipv6Mode {
    type Error = String;
    fn try_from(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Ipv6Mode::Auto),
            "off" => Ok(Ipv6Mode::Off),
            _ => Err(format!("'{s}' is not 'auto' or 'off'")),
        }
    }
}

impl TryFrom<String> for Ipv6Mode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Ipv6Mode::try_from(s.as_str())
    }
}

/// `flow_log`: which flow records go to the journal (docs/flows.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(into = "String", try_from = "String")]
pub enum FlowLog {
    /// None.
    Off,
    /// Refusals only.
    #[default]
    Denied,
    /// Every record: starts, ends and refusals.
    All,
}

impl From<FlowLog> for String {
    fn from(m: FlowLog) -> String {
        match m {
            FlowLog::Off => "off".into(),
            FlowLog::Denied => "denied".into(),
            FlowLog::All => "all".into(),
        }
    }
}

impl TryFrom<&str> for FlowLog {
    type Error = String;
    fn try_from(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(FlowLog::Off),
            "denied" => Ok(FlowLog::Denied),
            "all" => Ok(FlowLog::All),
            _ => Err(format!("'{s}' is not 'off', 'denied' or 'all'")),
        }
    }
}

impl TryFrom<String> for FlowLog {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        FlowLog::try_from(s.as_str())
    }
}

/// `deny_action`: what a sandbox gets for a packet the datapath refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(into = "String", try_from = "String")]
pub enum DenyAction {
    /// Nothing (the packet is dropped).
    #[default]
    Drop,
    /// A refused TCP SYN gets an RST, anything else an ICMP/ICMPv6
    /// administratively prohibited, from the gateway (rate-limited).
    Reject,
}

impl From<DenyAction> for String {
    fn from(m: DenyAction) -> String {
        match m {
            DenyAction::Drop => "drop".into(),
            DenyAction::Reject => "reject".into(),
        }
    }
}

impl TryFrom<&str> for DenyAction {
    type Error = String;
    fn try_from(s: &str) -> Result<Self, String> {
        match s {
            "drop" => Ok(DenyAction::Drop),
            "reject" => Ok(DenyAction::Reject),
            _ => Err(format!("'{s}' is not 'drop' or 'reject'")),
        }
    }
}

impl TryFrom<String> for DenyAction {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        DenyAction::try_from(s.as_str())
    }
}

/// Which packet datapath programs the sandboxes' traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum DatapathKind {
    /// Proxy ARP, SNAT, port mappings and policy in eBPF.
    Ebpf,
    /// TAPs, addresses, neighbours and records only.
    None,
}

impl From<DatapathKind> for String {
    fn from(k: DatapathKind) -> String {
        match k {
            DatapathKind::Ebpf => "ebpf".into(),
            DatapathKind::None => "none".into(),
        }
    }
}

impl TryFrom<&str> for DatapathKind {
    type Error = String;
    fn try_from(s: &str) -> Result<Self, String> {
        match s {
            "ebpf" => Ok(DatapathKind::Ebpf),
            "none" => Ok(DatapathKind::None),
            _ => Err(format!("'{s}' is not 'ebpf' or 'none'")),
        }
    }
}

impl TryFrom<String> for DatapathKind {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        DatapathKind::try_from(s.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Bus to serve on: "system", "session" or a D-Bus address.
    pub bus: BusChoice,
    /// Pool of host-side sandbox addresses.
    pub pool_cidr: String,
    /// Gateway device holding the pool's first address.
    pub gateway_device: String,
    /// Node uplink (SNAT address owner); "" = interface of the default route.
    pub uplink: String,
    /// Prefix marking TAPs as ours (at most 7 characters).
    pub tap_prefix: String,
    /// Number of ready TAPs kept in the warm pool.
    pub warm_pool: u32,
    /// Default TAP / guest MTU.
    pub mtu: u32,
    /// What every guest sees.
    pub guest_ip: String,
    pub guest_prefix_len: u8,
    pub guest_gateway: String,
    pub guest_mac: String,
    pub gateway_mac: String,
    /// "auto" (default): guests get an IPv6 link (fixed ULA prefix by
    /// Router Advertisement, gateway addresses, fast refusal off the
    /// link); "off": a guest's IPv6 is dropped.
    pub ipv6: Ipv6Mode,
    /// The datapath's flow events (docs/flows.md): on (default), every
    /// flow's start and every refusal is recorded (history, `WatchFlows`,
    /// the journal per `flow_log`); off, none is.
    pub flow_events: bool,
    /// Which flow records go to the journal: "off", "denied" (default),
    /// "all".
    pub flow_log: FlowLog,
    /// What a sandbox gets for a refused packet: "drop" (default) or
    /// "reject" (an RST or ICMP administratively prohibited).
    pub deny_action: DenyAction,
    /// The /96 of the sandboxes' node-side IPv6 identities (host <->
    /// sandbox over IPv6): a sandbox's is this prefix with its IPv4
    /// sandbox address as the last 32 bits, the gateway device's the same
    /// with the pool's gateway address.
    pub ipv6_pool: String,
    /// Automatic host ports for port mappings come from this range.
    pub host_port_range: String,
    /// Ports never chosen automatically (kernel `ip_local_reserved_ports`
    /// syntax); the kernel's own list is added at start.
    pub reserved_host_ports: String,
    /// Explicit host ports a caller may ask for outside `host_port_range`
    /// (same syntax; default: none, the range only).
    pub allowed_host_ports: String,
    /// Default bind address for port mappings that give none.
    pub default_host_ip: String,
    /// Durable records; `$STATE_DIRECTORY` when set by systemd.
    pub state_dir: PathBuf,
    /// Runtime files; `$RUNTIME_DIRECTORY` when set by systemd.
    pub runtime_dir: PathBuf,
    /// Link group used to delete retired TAPs in one batch.
    pub retire_group: u32,
    /// "ebpf" (proxy ARP, SNAT, port mappings, policy) or "none".
    pub datapath: DatapathKind,
    /// bpffs directory for this instance's pinned maps.
    pub bpf_pin_dir: PathBuf,
    /// The shared tc block every TAP's clsact ingress is bound to (its
    /// one filter runs `from_guest` for all of them); their egress hooks
    /// share the (empty) block `tc_block + 1`.
    pub tc_block: u32,
    /// A persistent, down TAP of the agent's that keeps the block alive
    /// while no sandbox TAP exists.
    pub tc_block_anchor: String,
    /// SNAT source ports for guest flows, "LO-HI" or "auto" (the default):
    /// the largest range of ports 1024-65535 outside the host's own
    /// ephemeral ports (`net.ipv4.ip_local_port_range`), `host_port_range`
    /// and `allowed_host_ports`, so the host's own connections never pick a
    /// port a sandbox flow uses (docs/datapath.md). An explicit range must
    /// stay outside those too.
    pub snat_port_range: String,
    /// Idle timeouts of datapath flows, seconds.
    pub flow_timeout_tcp: u32,
    pub flow_timeout_tcp_closing: u32,
    pub flow_timeout_udp: u32,
    pub flow_timeout_icmp: u32,
    /// `tracing` filter, e.g. "info" or "cube_network_agent=debug".
    pub log_level: String,
    /// varlink connections open at once, and per peer uid (systemd's
    /// sd-varlink defaults); a connection beyond either is refused with
    /// LimitsExceeded.
    pub varlink_max_connections: u32,
    pub varlink_max_connections_per_uid: u32,
    /// The `io.systemd.Metrics` socket (what `systemd-report` collects and
    /// `cubenetctl metrics` reads); empty = none.
    pub report_socket: PathBuf,
    /// A file rewritten every `metrics_interval` seconds with the
    /// OpenMetrics text (node_exporter's textfile collector); empty = none.
    pub metrics_textfile: PathBuf,
    pub metrics_interval: u32,
    /// Roots (a PEM file) the proxy verifies the upstreams of egress rules
    /// against; empty = the system store
    /// (/etc/ssl/certs/ca-certificates.crt). docs/egress.md.
    pub egress_trust_bundle: PathBuf,
    /// Where the resolver for sandboxes (on the gateway device's address,
    /// port 53) forwards allowed queries: "ADDR" or "ADDR:PORT"; empty =
    /// the first IPv4 nameserver of /etc/resolv.conf.
    pub dns_upstream: String,
    /// A learned address lets a sandbox with domain rules start flows for
    /// the answer's TTL clamped to this range, seconds (docs/egress.md).
    pub dns_ttl_min: u32,
    pub dns_ttl_max: u32,
    /// uids (besides root) whose processes may open connections to sandbox
    /// addresses (docs/security.md); port mappings are open to every
    /// local process regardless.
    pub host_access_uids: Vec<u32>,
    /// Bandwidth limits of a sandbox whose EnsureNetwork gives none, bits
    /// per second with an optional k/M/G suffix ("100M"); "" = unlimited.
    pub default_egress_rate: String,
    pub default_ingress_rate: String,
    /// The uplink's capacity each way ("10G"; "" = not set): Capacity
    /// reports the limits committed against it, and EnsureNetwork refuses
    /// (NodeFull) a limit that would commit more.
    pub node_egress_rate: String,
    pub node_ingress_rate: String,
    /// Labels of the node (free-form), reported by Capacity and metrics.
    pub labels: BTreeMap<String, String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bus: BusChoice::System,
            pool_cidr: "192.168.0.0/18".into(),
            gateway_device: "cube-dev".into(),
            uplink: String::new(),
            tap_prefix: "ctap".into(),
            warm_pool: 16,
            mtu: 1300,
            guest_ip: "169.254.68.6".into(),
            guest_prefix_len: 30,
            guest_gateway: "169.254.68.5".into(),
            guest_mac: "20:90:6f:fc:fc:fc".into(),
            gateway_mac: "20:90:6f:cf:cf:cf".into(),
            ipv6: Ipv6Mode::Auto,
            flow_events: true,
            flow_log: FlowLog::Denied,
            deny_action: DenyAction::Drop,
            ipv6_pool: "fd63:7562:6501::/96".into(),
            host_port_range: "20000-29999".into(),
            reserved_host_ports: String::new(),
            allowed_host_ports: String::new(),
            default_host_ip: "0.0.0.0".into(),
            state_dir: env_dir("STATE_DIRECTORY", "/var/lib/cube-network-agent"),
            runtime_dir: env_dir("RUNTIME_DIRECTORY", "/run/cube-network-agent"),
            retire_group: 0xc0be,
            datapath: DatapathKind::Ebpf,
            bpf_pin_dir: "/sys/fs/bpf/cube-network-agent".into(),
            tc_block: 0xc0be,
            tc_block_anchor: "cube-blk".into(),
            snat_port_range: "auto".into(),
            flow_timeout_tcp: 600,
            flow_timeout_tcp_closing: 10,
            flow_timeout_udp: 60,
            flow_timeout_icmp: 30,
            log_level: "info".into(),
            varlink_max_connections: 4096,
            varlink_max_connections_per_uid: 1024,
            report_socket: REPORT_SOCKET.into(),
            metrics_textfile: PathBuf::new(),
            metrics_interval: 15,
            dns_upstream: String::new(),
            egress_trust_bundle: PathBuf::new(),
            dns_ttl_min: 5,
            dns_ttl_max: 300,
            host_access_uids: Vec::new(),
            default_egress_rate: String::new(),
            default_ingress_rate: String::new(),
            node_egress_rate: String::new(),
            node_ingress_rate: String::new(),
            labels: BTreeMap::new(),
        }
    }
}

/// `dns_upstream`: "ADDR" (port 53) or "ADDR:PORT", IPv4.
pub fn parse_upstream(s: &str) -> Option<std::net::SocketAddrV4> {
    if let Ok(a) = s.parse::<std::net::SocketAddrV4>() {
        return Some(a);
    }
    s.parse::<Ipv4Addr>()
        .ok()
        .map(|ip| std::net::SocketAddrV4::new(ip, 53))
}

/// The upstream resolver: `dns_upstream`, else the first IPv4
/// `nameserver` of /etc/resolv.conf.
pub fn dns_upstream(cfg: &Config) -> Option<std::net::SocketAddrV4> {
    if !cfg.dns_upstream.is_empty() {
        return parse_upstream(&cfg.dns_upstream);
    }
    std::fs::read_to_string("/etc/resolv.conf")
        .ok()?
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .map(|ip| std::net::SocketAddrV4::new(ip, 53))
}

/// Where systemd (v260+) looks for services' metrics sockets.
pub const REPORT_SOCKET: &str = "/run/systemd/report/org.cube.NetworkAgent";

/// systemd may pass several colon-separated directories; the first is ours.
fn env_dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .and_then(|v| {
            v.to_str()
                .and_then(|s| s.split(':').next())
                .map(PathBuf::from)
        })
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from(default))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key}: {why}")]
    Invalid { key: &'static str, why: String },
    #[error("{0}")]
    Usage(String),
}

fn invalid(key: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        why: why.into(),
    }
}

/// Settings derived from a validated [`Config`].
#[derive(Debug, Clone)]
pub struct Derived {
    pub pool: Ipv4Cidr,
    pub guest_ip: Ipv4Addr,
    pub guest_gateway: Ipv4Addr,
    pub guest_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
    pub port_low: u16,
    pub port_high: u16,
    pub reserved_ports: PortSet,
    pub allowed_ports: PortSet,
    pub default_host_ip: Ipv4Addr,
    pub snat_ports: (u16, u16),
    /// `default_egress_rate`/`default_ingress_rate`, bits/s (0 = unlimited).
    pub default_bandwidth: crate::types::Bandwidth,
    /// `node_egress_rate`/`node_ingress_rate`, bits/s (0 = not set).
    pub node_egress_bps: u64,
    pub node_ingress_bps: u64,
    /// `ipv6_pool`'s first 96 bits.
    pub ipv6_pool: [u8; 12],
}

/// `ipv6_pool`: an IPv6 /96 whose host bits are zero, not one the node
/// cannot route to a device (multicast, link-local, loopback, unspecified,
/// IPv4-mapped).
fn parse_ipv6_pool(s: &str) -> Result<[u8; 12], String> {
    let (a, len) = s
        .split_once('/')
        .ok_or_else(|| format!("'{s}' is not a CIDR (an IPv6 /96, e.g. fd63:7562:6501::/96)"))?;
    let addr: std::net::Ipv6Addr = a
        .parse()
        .map_err(|_| format!("'{a}' is not an IPv6 address"))?;
    if len != "96" {
        return Err(format!(
            "'{s}' must be a /96 (the sandbox's IPv4 address makes its last 32 bits)"
        ));
    }
    let o = addr.octets();
    if o[12..] != [0; 4] {
        return Err(format!(
            "'{s}' has host bits set (the last 32 bits must be 0)"
        ));
    }
    if addr.is_multicast()
        || addr.is_unspecified()
        || addr.is_loopback()
        || (o[0] == 0xfe && o[1] & 0xc0 == 0x80)
        || addr.to_ipv4_mapped().is_some()
    {
        return Err(format!(
            "'{s}' is not a unicast prefix a device can be routed to (multicast, link-local, loopback or IPv4-mapped)"
        ));
    }
    let mut p = [0; 12];
    p.copy_from_slice(&o[..12]);
    Ok(p)
}

impl Derived {
    /// `ipv6_pool` ‖ `v4`: a sandbox's IPv6 identity (its sandbox address
    /// as `v4`), the gateway device's (the pool's gateway), or with
    /// 0.0.0.0 the /96 itself.
    pub fn pool6_addr(&self, v4: Ipv4Addr) -> std::net::Ipv6Addr {
        let mut o = [0; 16];
        o[..12].copy_from_slice(&self.ipv6_pool);
        o[12..].copy_from_slice(&v4.octets());
        o.into()
    }
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Interface names: 1..=15 bytes, no '/', ':' or whitespace (dev_valid_name).
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() < libc::IFNAMSIZ
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace())
}

/// The host's own ephemeral ports (`net.ipv4.ip_local_port_range` of the
/// agent's network namespace), if readable.
pub fn host_ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((it.next()??, it.next()??))
}

fn overlaps(a: (u16, u16), b: (u16, u16)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

/// The largest range of ports 1024-65535 that overlaps none of `taken`
/// and holds no port of `points`; ties go to the lower range.
pub fn largest_free_range(taken: &[(u16, u16)], points: &PortSet) -> Option<(u16, u16)> {
    let mut best: Option<(u16, u16)> = None;
    let mut start: Option<u16> = None;
    for p in 1024..=u16::MAX {
        let free = !points.contains(p) && !taken.iter().any(|r| (r.0..=r.1).contains(&p));
        match (free, start) {
            (true, None) => start = Some(p),
            (false, Some(s)) => {
                if best.is_none_or(|b| p - s > b.1 - b.0 + 1) {
                    best = Some((s, p - 1));
                }
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start
        && best.is_none_or(|b| u16::MAX - s > b.1 - b.0)
    {
        best = Some((s, u16::MAX));
    }
    best
}

impl Config {
    /// The SNAT port range: "auto" or an explicit one, never overlapping
    /// the host's ephemeral ports (`ephemeral`, when known), the automatic
    /// host ports of port mappings (`host_range`) or the explicitly allowed
    /// ones: a SNAT port the host's own connections can pick is a sandbox
    /// connection the host can reset, or a host reply a sandbox receives.
    pub fn snat_ports(
        &self,
        ephemeral: Option<(u16, u16)>,
        host_range: (u16, u16),
        allowed: &PortSet,
    ) -> Result<(u16, u16), ConfigError> {
        let mut taken = vec![host_range];
        taken.extend(ephemeral);
        if self.snat_port_range == "auto" {
            return largest_free_range(&taken, allowed)
                .filter(|r| r.1 - r.0 >= 1023)
                .ok_or_else(|| {
                    invalid(
                        "snat_port_range",
                        format!(
                            "auto: ports 1024-65535 outside the host's ephemeral ports {} and \
                             host_port_range {} leave no range of 1024 ports; set one explicitly",
                            ephemeral.map_or("(unknown)".into(), |(a, b)| format!("{a}-{b}")),
                            self.host_port_range
                        ),
                    )
                });
        }
        let snat = parse_range(&self.snat_port_range)
            .map_err(|e| invalid("snat_port_range", e.to_string()))?;
        if overlaps(snat, host_range) {
            return Err(invalid(
                "snat_port_range",
                format!(
                    "{} overlaps host_port_range {}",
                    self.snat_port_range, self.host_port_range
                ),
            ));
        }
        if let Some(e) = ephemeral
            && overlaps(snat, e)
        {
            return Err(invalid(
                "snat_port_range",
                format!(
                    "{} overlaps the host's own ephemeral ports {}-{} \
                     (net.ipv4.ip_local_port_range): the kernel would give the host's \
                     connections ports that sandbox flows hold; use \"auto\" or a range \
                     outside it",
                    self.snat_port_range, e.0, e.1
                ),
            ));
        }
        if let Some(p) = (snat.0..=snat.1).find(|p| allowed.contains(*p)) {
            return Err(invalid(
                "snat_port_range",
                format!(
                    "{} contains port {p} of allowed_host_ports (mapped by sandboxes)",
                    self.snat_port_range
                ),
            ));
        }
        Ok(snat)
    }

    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            // Say which line and key, so "invalid type" is actionable.
            let place = e.span().map(|span| {
                let line_no = text[..span.start.min(text.len())].matches('\n').count() + 1;
                let line = text.lines().nth(line_no - 1).unwrap_or("");
                match line.split_once('=') {
                    Some((key, _)) => format!("line {line_no}, key '{}': ", key.trim()),
                    None => format!("line {line_no}: "),
                }
            });
            ConfigError::Parse {
                path: path.to_owned(),
                message: place.unwrap_or_default() + e.message(),
            }
        })
    }

    /// Reads the file; a missing file at the default path means "all defaults".
    pub fn load(path: &Path, explicit: bool) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::from_toml(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// Checks every value and derives the typed settings.
    pub fn validate(&self) -> Result<Derived, ConfigError> {
        let pool: Ipv4Cidr = self
            .pool_cidr
            .parse()
            .map_err(|e| invalid("pool_cidr", format!("{e}")))?;
        if IpAllocator::new(pool).is_none() {
            return Err(invalid(
                "pool_cidr",
                format!(
                    "{pool} is too small: need at least a /{} (network, gateway and broadcast are reserved)",
                    IpAllocator::MAX_PREFIX_LEN
                ),
            ));
        }
        if !(MIN_MTU..=MAX_MTU).contains(&self.mtu) {
            return Err(invalid(
                "mtu",
                format!("{} is out of range {MIN_MTU}-{MAX_MTU}", self.mtu),
            ));
        }
        if !valid_ifname(&self.gateway_device) {
            return Err(invalid(
                "gateway_device",
                format!(
                    "'{}' is not a valid interface name (1-15 chars, no '/', ':' or spaces)",
                    self.gateway_device
                ),
            ));
        }
        if !self.uplink.is_empty() && !valid_ifname(&self.uplink) {
            return Err(invalid(
                "uplink",
                format!("'{}' is not a valid interface name", self.uplink),
            ));
        }
        if self.tap_prefix.is_empty()
            || self.tap_prefix.len() > MAX_TAP_PREFIX
            || !self
                .tap_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(invalid(
                "tap_prefix",
                format!(
                    "'{}' must be 1-{MAX_TAP_PREFIX} characters of [A-Za-z0-9_-] so that names fit IFNAMSIZ",
                    self.tap_prefix
                ),
            ));
        }
        if !valid_ifname(&self.tc_block_anchor) {
            return Err(invalid(
                "tc_block_anchor",
                format!(
                    "'{}' is not a valid interface name (1-15 chars, no '/', ':' or spaces)",
                    self.tc_block_anchor
                ),
            ));
        }
        for (what, other) in [
            ("gateway_device", &self.gateway_device),
            ("uplink", &self.uplink),
        ] {
            if &self.tc_block_anchor == other {
                return Err(invalid(
                    "tc_block_anchor",
                    format!("'{other}' is the {what}; the anchor is a device of its own"),
                ));
            }
        }
        if self.tc_block == 0 || self.tc_block == u32::MAX {
            return Err(invalid(
                "tc_block",
                format!(
                    "{} is not a block the agent can use: pick 1-4294967294 (it uses the block \
                     and the next one)",
                    self.tc_block
                ),
            ));
        }
        if self.tc_block_anchor.starts_with(&self.tap_prefix) {
            return Err(invalid(
                "tap_prefix",
                format!(
                    "'{}' would also match the tc block anchor '{}'",
                    self.tap_prefix, self.tc_block_anchor
                ),
            ));
        }
        if self.gateway_device.starts_with(&self.tap_prefix) {
            return Err(invalid(
                "tap_prefix",
                format!(
                    "'{}' would also match the gateway device '{}'",
                    self.tap_prefix, self.gateway_device
                ),
            ));
        }
        if self.warm_pool > 4096 {
            return Err(invalid(
                "warm_pool",
                format!("{} is more than 4096", self.warm_pool),
            ));
        }
        let guest_ip: Ipv4Addr = self.guest_ip.parse().map_err(|_| {
            invalid(
                "guest_ip",
                format!("'{}' is not an IPv4 address", self.guest_ip),
            )
        })?;
        let guest_gateway: Ipv4Addr = self.guest_gateway.parse().map_err(|_| {
            invalid(
                "guest_gateway",
                format!("'{}' is not an IPv4 address", self.guest_gateway),
            )
        })?;
        if !(1..=30).contains(&self.guest_prefix_len) {
            return Err(invalid(
                "guest_prefix_len",
                format!("{} is not in 1-30", self.guest_prefix_len),
            ));
        }
        let guest_net = Ipv4Cidr::new(
            Ipv4Addr::from(
                u32::from(guest_ip) & (u32::MAX << (32 - u32::from(self.guest_prefix_len))),
            ),
            self.guest_prefix_len,
        )
        .expect("masked address has no host bits");
        if !guest_net.contains(guest_gateway) || guest_gateway == guest_ip {
            return Err(invalid(
                "guest_gateway",
                format!("{guest_gateway} must be another address inside {guest_net}"),
            ));
        }
        let guest_mac = parse_mac(&self.guest_mac).ok_or_else(|| {
            invalid(
                "guest_mac",
                format!("'{}' is not a MAC like 20:90:6f:fc:fc:fc", self.guest_mac),
            )
        })?;
        let gateway_mac = parse_mac(&self.gateway_mac).ok_or_else(|| {
            invalid(
                "gateway_mac",
                format!("'{}' is not a MAC like 20:90:6f:cf:cf:cf", self.gateway_mac),
            )
        })?;
        for (key, mac) in [("guest_mac", guest_mac), ("gateway_mac", gateway_mac)] {
            if mac[0] & 1 == 1 || mac == [0; 6] {
                return Err(invalid(key, "must be a unicast, non-zero MAC"));
            }
        }
        if guest_mac == gateway_mac {
            return Err(invalid("gateway_mac", "must differ from guest_mac"));
        }
        let (port_low, port_high) = parse_range(&self.host_port_range)
            .map_err(|e| invalid("host_port_range", e.to_string()))?;
        let reserved_ports: PortSet =
            self.reserved_host_ports
                .parse()
                .map_err(|e: crate::alloc::port::PortListError| {
                    invalid("reserved_host_ports", e.to_string())
                })?;
        let allowed_ports: PortSet =
            self.allowed_host_ports
                .parse()
                .map_err(|e: crate::alloc::port::PortListError| {
                    invalid("allowed_host_ports", e.to_string())
                })?;
        if allowed_ports.contains(0) {
            return Err(invalid("allowed_host_ports", "port 0 is not a port"));
        }
        if (port_low..=port_high).all(|p| reserved_ports.contains(p)) {
            return Err(invalid(
                "reserved_host_ports",
                "excludes every port of host_port_range",
            ));
        }
        let ipv6_pool =
            parse_ipv6_pool(&self.ipv6_pool).map_err(|why| invalid("ipv6_pool", why))?;
        let default_host_ip: Ipv4Addr = self.default_host_ip.parse().map_err(|_| {
            invalid(
                "default_host_ip",
                format!("'{}' is not an IPv4 address", self.default_host_ip),
            )
        })?;
        for (key, dir) in [
            ("state_dir", &self.state_dir),
            ("runtime_dir", &self.runtime_dir),
        ] {
            if !dir.is_absolute() {
                return Err(invalid(
                    key,
                    format!("'{}' must be an absolute path", dir.display()),
                ));
            }
        }
        if !self.bpf_pin_dir.is_absolute() {
            return Err(invalid(
                "bpf_pin_dir",
                format!("'{}' must be an absolute path", self.bpf_pin_dir.display()),
            ));
        }
        let ephemeral = host_ephemeral_ports();
        let snat_ports = self.snat_ports(ephemeral, (port_low, port_high), &allowed_ports)?;
        for (key, v) in [
            ("flow_timeout_tcp", self.flow_timeout_tcp),
            ("flow_timeout_tcp_closing", self.flow_timeout_tcp_closing),
            ("flow_timeout_udp", self.flow_timeout_udp),
            ("flow_timeout_icmp", self.flow_timeout_icmp),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be at least 1 second"));
            }
        }
        if !(1..=86_400).contains(&self.metrics_interval) {
            return Err(invalid(
                "metrics_interval",
                format!("{} is not 1-86400 seconds", self.metrics_interval),
            ));
        }
        if self.dns_ttl_min == 0 || self.dns_ttl_min > self.dns_ttl_max || self.dns_ttl_max > 86_400
        {
            return Err(invalid(
                "dns_ttl_min",
                format!(
                    "{}-{} is not a range of 1-86400 seconds (dns_ttl_min <= dns_ttl_max)",
                    self.dns_ttl_min, self.dns_ttl_max
                ),
            ));
        }
        if self.host_access_uids.len() >= crate::datapath::maps::HOST_ACCESS_ENTRIES as usize {
            return Err(invalid(
                "host_access_uids",
                format!(
                    "{} uids; at most {}",
                    self.host_access_uids.len(),
                    crate::datapath::maps::HOST_ACCESS_ENTRIES - 1
                ),
            ));
        }
        if self.host_access_uids.contains(&65534) {
            return Err(invalid(
                "host_access_uids",
                "65534 (nobody) is the uid the kernel reports for a packet without a socket: \
                 granting it would admit those too",
            ));
        }
        if !self.dns_upstream.is_empty() && parse_upstream(&self.dns_upstream).is_none() {
            return Err(invalid(
                "dns_upstream",
                format!("'{}' is not ADDR or ADDR:PORT (IPv4)", self.dns_upstream),
            ));
        }
        for (key, p) in [
            ("report_socket", &self.report_socket),
            ("metrics_textfile", &self.metrics_textfile),
            ("egress_trust_bundle", &self.egress_trust_bundle),
        ] {
            if !p.as_os_str().is_empty() && !p.is_absolute() {
                return Err(invalid(
                    key,
                    format!("'{}' is not an absolute path", p.display()),
                ));
            }
        }
        if self.varlink_max_connections == 0 || self.varlink_max_connections_per_uid == 0 {
            return Err(invalid(
                if self.varlink_max_connections == 0 {
                    "varlink_max_connections"
                } else {
                    "varlink_max_connections_per_uid"
                },
                "must be at least 1",
            ));
        }
        if self.retire_group == 0 {
            return Err(invalid(
                "retire_group",
                "0 is the default group of every link; pick another",
            ));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log_level) {
            return Err(invalid(
                "log_level",
                format!(
                    "'{}' is not a tracing filter ({e}); e.g. info, debug, \
                     cube_network_agent=debug",
                    self.log_level
                ),
            ));
        }
        let rate = |key: &'static str, v: &str| -> Result<u64, ConfigError> {
            if v.is_empty() {
                return Ok(0);
            }
            let r = crate::types::parse_rate(v).map_err(|why| invalid(key, why))?;
            if !(crate::types::MIN_RATE_BPS..=crate::types::MAX_RATE_BPS).contains(&r) {
                return Err(invalid(
                    key,
                    format!(
                        "{r} bits/s is out of range {}-{}",
                        crate::types::MIN_RATE_BPS,
                        crate::types::MAX_RATE_BPS
                    ),
                ));
            }
            Ok(r)
        };
        let default_bandwidth = crate::types::Bandwidth {
            egress_bps: rate("default_egress_rate", &self.default_egress_rate)?,
            ingress_bps: rate("default_ingress_rate", &self.default_ingress_rate)?,
            ..Default::default()
        };
        let node_egress_bps = rate("node_egress_rate", &self.node_egress_rate)?;
        let node_ingress_bps = rate("node_ingress_rate", &self.node_ingress_rate)?;
        for (k, v) in &self.labels {
            if k.is_empty()
                || k.len() > 64
                || !k
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'/'))
            {
                return Err(invalid(
                    "labels",
                    format!("'{k}' is not a label name (1-64 of A-Z a-z 0-9 _ . - /)"),
                ));
            }
            if v.len() > 256 || v.chars().any(char::is_control) {
                return Err(invalid(
                    "labels",
                    format!("the value of '{k}' must be at most 256 printable characters"),
                ));
            }
        }
        Ok(Derived {
            ipv6_pool,
            default_bandwidth,
            node_egress_bps,
            node_ingress_bps,
            pool,
            guest_ip,
            guest_gateway,
            guest_mac,
            gateway_mac,
            port_low,
            port_high,
            reserved_ports,
            allowed_ports,
            default_host_ip,
            snat_ports,
        })
    }
}

pub const USAGE: &str = "\
Usage: cube-network-agent [OPTIONS]

Node-local network agent for micro-VM sandboxes (D-Bus: org.cube.NetworkAgent).

Options (each overrides the same key of the config file):
  --config PATH              config file [default: /etc/cube-network-agent/config.toml]
  --bus system|session|ADDR  bus to serve on [default: system]
  --pool-cidr CIDR           sandbox address pool [default: 192.168.0.0/18]
  --gateway-device NAME      gateway device [default: cube-dev]
  --uplink NAME              node uplink [default: interface of the default route]
  --tap-prefix PREFIX        TAP name prefix, at most 7 chars [default: ctap]
  --warm-pool N              ready TAPs kept in the pool [default: 16]
  --mtu N                    default TAP MTU [default: 1300]
  --host-port-range LO-HI    automatic host ports [default: 20000-29999]
  --reserved-host-ports LIST never chosen automatically, e.g. 22,8000-8100
  --allowed-host-ports LIST  explicit host ports allowed outside the range, e.g. 80,443 [default: none]
  --state-dir PATH           durable records [default: $STATE_DIRECTORY or /var/lib/cube-network-agent]
  --runtime-dir PATH         runtime files [default: $RUNTIME_DIRECTORY or /run/cube-network-agent]
  --datapath ebpf|none       packet datapath [default: ebpf]
  --flow-events on|off       the datapath's flow records (starts, refusals) [default: on]
  --flow-log off|denied|all  flow records written to the journal [default: denied]
  --deny-action drop|reject  a refused packet: dropped, or answered (RST, ICMP) [default: drop]
  --ipv6 auto|off            the guests' IPv6 link (RA, fast refusal off it) [default: auto]
  --ipv6-pool CIDR           /96 of the sandboxes' node-side IPv6 addresses [default: fd63:7562:6501::/96]
  --bpf-pin-dir PATH         bpffs directory for pinned maps [default: /sys/fs/bpf/cube-network-agent]
  --tc-block N               shared tc block of every TAP's ingress (N+1: egress) [default: 49342]
  --tc-block-anchor NAME     down TAP that keeps the block alive [default: cube-blk]
  --snat-port-range LO-HI    SNAT source ports, or auto [default: auto: outside the host's ephemeral ports]
  --flow-timeout-udp SECS    idle timeout of UDP flows [default: 60] (also -tcp, -tcp-closing, -icmp)
  --log-level FILTER         tracing filter [default: info]
  --varlink-max-connections N          varlink connections at once [default: 4096]
  --varlink-max-connections-per-uid N  ... of one peer uid [default: 1024]
  --report-socket PATH       io.systemd.Metrics socket, \"\" for none [default: /run/systemd/report/org.cube.NetworkAgent]
  --metrics-textfile PATH    OpenMetrics file for node_exporter [default: none]
  --metrics-interval SECS    how often it is rewritten [default: 15]
  --dns-upstream ADDR[:PORT] where the sandboxes' resolver forwards [default: resolv.conf's first]
  --egress-trust-bundle PEM roots for egress rules' upstreams [default: the system store]
  --dns-ttl-min SECS         learned addresses last at least [default: 5]
  --dns-ttl-max SECS         ... and at most this long [default: 300]
  --host-access-uids LIST    uids besides root that may connect to sandbox addresses, e.g. 1000,1001 [default: none]
  --default-egress-rate RATE limit of a sandbox that asks for none, bits/s, e.g. 100M [default: unlimited]
  --default-ingress-rate RATE  ... from the world to it [default: unlimited]
  --node-egress-rate RATE    the uplink's capacity out: limits beyond it are refused [default: not set]
  --node-ingress-rate RATE     ... and in [default: not set]
  --labels K=V,...           node labels reported by Capacity [default: none]
  --print-config             print the effective configuration as TOML and exit
  -h, --help                 this help
  -V, --version              version
";

/// What the command line asks for.
#[derive(Debug)]
pub enum Command {
    Run(Box<Config>),
    PrintConfig(Box<Config>),
    Help,
    Version,
}

/// Parses the command line (without argv[0]): config file first, then flags.
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, ConfigError> {
    let args: Vec<String> = args.into_iter().collect();
    let mut flags: Vec<(String, String)> = vec![];
    let mut config_path: Option<PathBuf> = None;
    let mut print = false;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            "--print-config" => {
                print = true;
                continue;
            }
            _ => {}
        }
        if !flag.starts_with("--") {
            return Err(ConfigError::Usage(format!(
                "unexpected argument '{arg}' (see --help)"
            )));
        }
        if flag != "--config" && !VALUE_FLAGS.contains(&flag.as_str()) {
            return Err(ConfigError::Usage(format!(
                "unknown option '{flag}' (see --help)"
            )));
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| ConfigError::Usage(format!("{flag} needs a value")))?,
        };
        if flag == "--config" {
            config_path = Some(value.into());
        } else {
            flags.push((flag, value));
        }
    }
    let explicit = config_path.is_some();
    let path = config_path.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
    let mut cfg = Config::load(&path, explicit)?;
    for (flag, value) in flags {
        apply_flag(&mut cfg, &flag, value)?;
    }
    Ok(if print {
        Command::PrintConfig(Box::new(cfg))
    } else {
        Command::Run(Box::new(cfg))
    })
}

/// Every option that takes a value (besides `--config`); `apply_flag`
/// handles exactly these.
const VALUE_FLAGS: &[&str] = &[
    "--bus",
    "--pool-cidr",
    "--gateway-device",
    "--uplink",
    "--tap-prefix",
    "--warm-pool",
    "--mtu",
    "--host-port-range",
    "--reserved-host-ports",
    "--allowed-host-ports",
    "--state-dir",
    "--runtime-dir",
    "--log-level",
    "--datapath",
    "--flow-events",
    "--flow-log",
    "--deny-action",
    "--ipv6",
    "--ipv6-pool",
    "--bpf-pin-dir",
    "--tc-block",
    "--tc-block-anchor",
    "--snat-port-range",
    "--flow-timeout-tcp",
    "--flow-timeout-tcp-closing",
    "--flow-timeout-udp",
    "--flow-timeout-icmp",
    "--varlink-max-connections",
    "--varlink-max-connections-per-uid",
    "--report-socket",
    "--metrics-textfile",
    "--metrics-interval",
    "--dns-upstream",
    "--egress-trust-bundle",
    "--dns-ttl-min",
    "--dns-ttl-max",
    "--host-access-uids",
    "--default-egress-rate",
    "--default-ingress-rate",
    "--node-egress-rate",
    "--node-ingress-rate",
    "--labels",
];

fn apply_flag(cfg: &mut Config, flag: &str, value: String) -> Result<(), ConfigError> {
    let number = |key: &'static str, v: &str| -> Result<u32, ConfigError> {
        v.parse()
            .map_err(|_| invalid(key, format!("'{v}' is not a number")))
    };
    match flag {
        "--bus" => cfg.bus = BusChoice::try_from(value).map_err(|why| invalid("bus", why))?,
        "--pool-cidr" => cfg.pool_cidr = value,
        "--gateway-device" => cfg.gateway_device = value,
        "--uplink" => cfg.uplink = value,
        "--tap-prefix" => cfg.tap_prefix = value,
        "--warm-pool" => cfg.warm_pool = number("warm_pool", &value)?,
        "--mtu" => cfg.mtu = number("mtu", &value)?,
        "--host-port-range" => cfg.host_port_range = value,
        "--reserved-host-ports" => cfg.reserved_host_ports = value,
        "--allowed-host-ports" => cfg.allowed_host_ports = value,
        "--state-dir" => cfg.state_dir = value.into(),
        "--runtime-dir" => cfg.runtime_dir = value.into(),
        "--log-level" => cfg.log_level = value,
        "--datapath" => {
            cfg.datapath =
                DatapathKind::try_from(value.as_str()).map_err(|why| invalid("datapath", why))?
        }
        "--flow-events" => {
            cfg.flow_events = match value.as_str() {
                "on" => true,
                "off" => false,
                other => {
                    return Err(invalid(
                        "flow_events",
                        format!("'{other}' is not 'on' or 'off'"),
                    ));
                }
            }
        }
        "--flow-log" => {
            cfg.flow_log =
                FlowLog::try_from(value.as_str()).map_err(|why| invalid("flow_log", why))?
        }
        "--deny-action" => {
            cfg.deny_action =
                DenyAction::try_from(value.as_str()).map_err(|why| invalid("deny_action", why))?
        }
        "--ipv6" => {
            cfg.ipv6 = Ipv6Mode::try_from(value.as_str()).map_err(|why| invalid("ipv6", why))?
        }
        "--ipv6-pool" => cfg.ipv6_pool = value,
        "--bpf-pin-dir" => cfg.bpf_pin_dir = value.into(),
        "--tc-block" => cfg.tc_block = number("tc_block", &value)?,
        "--tc-block-anchor" => cfg.tc_block_anchor = value,
        "--snat-port-range" => cfg.snat_port_range = value,
        "--flow-timeout-tcp" => cfg.flow_timeout_tcp = number("flow_timeout_tcp", &value)?,
        "--flow-timeout-tcp-closing" => {
            cfg.flow_timeout_tcp_closing = number("flow_timeout_tcp_closing", &value)?
        }
        "--flow-timeout-udp" => cfg.flow_timeout_udp = number("flow_timeout_udp", &value)?,
        "--flow-timeout-icmp" => cfg.flow_timeout_icmp = number("flow_timeout_icmp", &value)?,
        "--varlink-max-connections" => {
            cfg.varlink_max_connections = number("varlink_max_connections", &value)?
        }
        "--varlink-max-connections-per-uid" => {
            cfg.varlink_max_connections_per_uid = number("varlink_max_connections_per_uid", &value)?
        }
        "--report-socket" => cfg.report_socket = value.into(),
        "--metrics-textfile" => cfg.metrics_textfile = value.into(),
        "--metrics-interval" => cfg.metrics_interval = number("metrics_interval", &value)?,
        "--dns-upstream" => cfg.dns_upstream = value,
        "--egress-trust-bundle" => cfg.egress_trust_bundle = value.into(),
        "--dns-ttl-min" => cfg.dns_ttl_min = number("dns_ttl_min", &value)?,
        "--dns-ttl-max" => cfg.dns_ttl_max = number("dns_ttl_max", &value)?,
        "--host-access-uids" => {
            cfg.host_access_uids = value
                .split(',')
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| number("host_access_uids", v))
                .collect::<Result<_, _>>()?
        }
        "--default-egress-rate" => cfg.default_egress_rate = value,
        "--default-ingress-rate" => cfg.default_ingress_rate = value,
        "--node-egress-rate" => cfg.node_egress_rate = value,
        "--node-ingress-rate" => cfg.node_ingress_rate = value,
        "--labels" => {
            cfg.labels = value
                .split(',')
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .ok_or_else(|| invalid("labels", format!("'{kv}' is not KEY=VALUE")))
                })
                .collect::<Result<_, _>>()?
        }
        _ => {
            return Err(ConfigError::Usage(format!(
                "unknown option {flag} (see --help)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn err_of(cfg: Config) -> String {
        cfg.validate().unwrap_err().to_string()
    }

    #[test]
    fn defaults_validate() {
        let d = Config::default().validate().unwrap();
        assert_eq!(d.pool.to_string(), "192.168.0.0/18");
        assert_eq!(d.guest_mac, [0x20, 0x90, 0x6f, 0xfc, 0xfc, 0xfc]);
        assert_eq!((d.port_low, d.port_high), (20000, 29999));
    }

    #[test]
    fn empty_file_is_all_defaults() {
        let c = Config::from_toml("", Path::new("x")).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn unknown_key_is_named() {
        let e = Config::from_toml(
            "pool_cidr = \"10.0.0.0/16\"\npool_size = 3\n",
            Path::new("c.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("pool_size"), "{e}");
        assert!(e.contains("c.toml"), "{e}");
    }

    #[test]
    fn wrong_type_is_reported() {
        let e = Config::from_toml("mtu = \"big\"", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1, key 'mtu'"), "{e}");
    }

    #[test]
    fn ipv6_pool_is_a_routable_96() {
        let d = Config::default().validate().unwrap();
        assert_eq!(
            d.ipv6_pool,
            [0xfd, 0x63, 0x75, 0x62, 0x65, 0x01, 0, 0, 0, 0, 0, 0]
        );
        for (bad, why) in [
            ("fd00::", "not a CIDR"),
            ("fd00::/64", "must be a /96"),
            ("fd00::1/96", "host bits"),
            ("10.0.0.0/96", "not an IPv6 address"),
            ("fe80::/96", "link-local"),
            ("ff02::/96", "multicast"),
            ("::ffff:0.0.0.0/96", "IPv4-mapped"),
        ] {
            let c = Config {
                ipv6_pool: bad.into(),
                ..Config::default()
            };
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("ipv6_pool") && e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn ipv6_mode_is_auto_or_off() {
        assert_eq!(Config::default().ipv6, Ipv6Mode::Auto);
        let c = Config::from_toml("ipv6 = \"off\"\n", Path::new("c.toml")).unwrap();
        assert_eq!(c.ipv6, Ipv6Mode::Off);
        let e = Config::from_toml("ipv6 = \"on\"\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'on' is not 'auto' or 'off'"), "{e}");
    }

    #[test]
    fn unknown_datapath_is_refused_when_read() {
        let e = Config::from_toml("datapath = \"xdp\"\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'xdp' is not 'ebpf' or 'none'"), "{e}");
        let c = Config::from_toml("datapath = \"none\"\n", Path::new("c.toml")).unwrap();
        assert_eq!(c.datapath, DatapathKind::None);
    }

    #[test]
    fn bad_values_name_the_key() {
        let cases: Vec<(Config, &str)> = vec![
            (
                Config {
                    pool_cidr: "10.0.0.0/33".into(),
                    ..Default::default()
                },
                "pool_cidr",
            ),
            (
                Config {
                    pool_cidr: "10.0.0.1/16".into(),
                    ..Default::default()
                },
                "10.0.0.0/16",
            ),
            (
                Config {
                    pool_cidr: "10.0.0.0/31".into(),
                    ..Default::default()
                },
                "too small",
            ),
            (
                Config {
                    mtu: 100,
                    ..Default::default()
                },
                "mtu",
            ),
            (
                Config {
                    mtu: 65000,
                    ..Default::default()
                },
                "out of range",
            ),
            (
                Config {
                    tap_prefix: "toolongprefix".into(),
                    ..Default::default()
                },
                "tap_prefix",
            ),
            (
                Config {
                    tap_prefix: "a/b".into(),
                    ..Default::default()
                },
                "tap_prefix",
            ),
            (
                Config {
                    tap_prefix: "cube-d".into(),
                    ..Default::default()
                },
                "gateway device",
            ),
            (
                Config {
                    tap_prefix: "cube".into(),
                    ..Default::default()
                },
                "tc block anchor",
            ),
            (
                Config {
                    gateway_device: "way-too-long-name".into(),
                    ..Default::default()
                },
                "gateway_device",
            ),
            (
                Config {
                    guest_mac: "zz:90:6f:fc:fc:fc".into(),
                    ..Default::default()
                },
                "guest_mac",
            ),
            (
                Config {
                    gateway_mac: "21:90:6f:fc:fc:fc".into(),
                    ..Default::default()
                },
                "unicast",
            ),
            (
                Config {
                    gateway_mac: "20:90:6f:fc:fc:fc".into(),
                    ..Default::default()
                },
                "differ",
            ),
            (
                Config {
                    guest_gateway: "10.0.0.1".into(),
                    ..Default::default()
                },
                "guest_gateway",
            ),
            (
                Config {
                    host_port_range: "30000-20000".into(),
                    ..Default::default()
                },
                "host_port_range",
            ),
            (
                Config {
                    host_port_range: "100-101".into(),
                    reserved_host_ports: "100-101".into(),
                    ..Default::default()
                },
                "excludes every port",
            ),
            (
                Config {
                    reserved_host_ports: "80,x".into(),
                    ..Default::default()
                },
                "reserved_host_ports",
            ),
            (
                Config {
                    state_dir: "relative".into(),
                    ..Default::default()
                },
                "state_dir",
            ),
            (
                Config {
                    warm_pool: 100_000,
                    ..Default::default()
                },
                "warm_pool",
            ),
            (
                Config {
                    snat_port_range: "25000-26000".into(),
                    ..Default::default()
                },
                "overlaps",
            ),
            (
                Config {
                    snat_port_range: "8000-9000".into(),
                    allowed_host_ports: "8080".into(),
                    ..Default::default()
                },
                "allowed_host_ports",
            ),
            (
                Config {
                    flow_timeout_udp: 0,
                    ..Default::default()
                },
                "flow_timeout_udp",
            ),
        ];
        for (cfg, want) in cases {
            let e = err_of(cfg);
            assert!(e.contains(want), "error {e:?} should mention {want:?}");
        }
    }

    #[test]
    fn snat_ports_stay_out_of_the_hosts_ports() {
        let none = PortSet::default();
        let eph = Some((32768, 60999));
        let auto = Config::default();
        // Defaults: the largest gap next to 20000-29999 and 32768-60999.
        assert_eq!(
            auto.snat_ports(eph, (20000, 29999), &none).unwrap(),
            (1024, 19999)
        );
        // Another ephemeral range, allowed ports cut ranges.
        assert_eq!(
            auto.snat_ports(Some((1024, 50000)), (20000, 29999), &none)
                .unwrap(),
            (50001, 65535)
        );
        let allowed: PortSet = "10000".parse().unwrap();
        assert_eq!(
            auto.snat_ports(eph, (20000, 29999), &allowed).unwrap(),
            (10001, 19999)
        );
        // Nothing left of 1024 ports: a clear error.
        let e = auto
            .snat_ports(Some((1024, 65535)), (20000, 29999), &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("snat_port_range") && e.contains("auto"), "{e}");
        // Explicit ranges must stay outside the host's ephemeral ports.
        let explicit = Config {
            snat_port_range: "32768-60999".into(),
            ..Default::default()
        };
        let e = explicit
            .snat_ports(eph, (20000, 29999), &none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("ip_local_port_range"), "{e}");
        assert_eq!(
            explicit
                .snat_ports(Some((1024, 20000)), (20001, 29999), &none)
                .unwrap(),
            (32768, 60999)
        );
    }

    #[test]
    fn flags_override_file() {
        let dir = std::env::temp_dir().join(format!("cna-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(&path, "warm_pool = 4\nmtu = 1400\n").unwrap();
        let cmd = parse_args(args(&[
            "--config",
            path.to_str().unwrap(),
            "--mtu=1500",
            "--bus",
            "unix:path=/tmp/x",
        ]))
        .unwrap();
        let Command::Run(cfg) = cmd else {
            panic!("expected run")
        };
        assert_eq!(cfg.warm_pool, 4);
        assert_eq!(cfg.mtu, 1500);
        assert_eq!(cfg.bus, BusChoice::Address("unix:path=/tmp/x".into()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_explicit_config_is_an_error() {
        let e = parse_args(args(&["--config", "/nonexistent/c.toml"])).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/c.toml"));
    }

    #[test]
    fn usage_errors() {
        for bogus in [&["--bogus"][..], &["--bogus", "1"], &["--bogus=1"]] {
            let e = parse_args(args(bogus)).unwrap_err().to_string();
            assert_eq!(e, "unknown option '--bogus' (see --help)", "{bogus:?}");
        }
        let e = err_of(Config {
            log_level: "info,=[".into(),
            ..Default::default()
        });
        assert!(e.starts_with("log_level:"), "{e}");
        assert!(
            parse_args(args(&["--mtu"]))
                .unwrap_err()
                .to_string()
                .contains("needs a value")
        );
        assert!(
            parse_args(args(&["--bus", "nope"]))
                .unwrap_err()
                .to_string()
                .contains("bus")
        );
        assert!(matches!(parse_args(args(&["--help"])), Ok(Command::Help)));
    }

    #[test]
    fn mac_roundtrip() {
        let m = parse_mac("20:90:6f:cf:cf:cf").unwrap();
        assert_eq!(format_mac(&m), "20:90:6f:cf:cf:cf");
        assert!(parse_mac("20:90:6f:cf:cf").is_none());
        assert!(parse_mac("20:90:6f:cf:cf:cf:00").is_none());
        assert!(parse_mac("2:90:6f:cf:cf:cf").is_none());
    }
}
