//! The CNI edge (`cube-cni`), pure part: the plugin configuration, the
//! attachment's identity, results in each spec version, error JSON and the
//! rules that turn the agent's answers into CNI verdicts. The binary
//! (`src/bin/cube-cni.rs`) does the I/O: environment, stdin, the agent
//! over D-Bus, and the work inside the container's namespace.
//!
//! Model (docs/cni.md): a veth per attachment; the agent creates the pair
//! (the peer directly in `CNI_NETNS`, from an fd the plugin passes), and the
//! host end plays a TAP's role in the datapath. Inside the container the
//! interface carries the fixed guest address (169.254.68.6/30, gateway
//! .5), exactly what a VM guest sees; the pod IP the runtime reports is the
//! sandbox address (unique on the node, routed to the container by the
//! datapath), listed first in `ips`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::{Map, Value, json};

/// Spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// CNI error codes (spec §"Error"); 100 and up are this plugin's own.
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO: u32 = 5;
    pub const DECODE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_READY: u32 = 50;
    pub const LIMITED_CONNECTIVITY: u32 = 51;
    /// The agent failed the request (its message follows).
    pub const AGENT_FAILED: u32 = 100;
    /// A port mapping's host port belongs to someone else (the host or
    /// another sandbox): not transient, retrying does not help.
    pub const PORT_IN_USE: u32 = 101;
    /// polkit said no.
    pub const ACCESS_DENIED: u32 = 102;
    /// CHECK: the agent has no network for this attachment.
    pub const NOT_FOUND: u32 = 103;
    /// ADD: `CNI_IFNAME` already exists in the namespace.
    pub const INTERFACE_EXISTS: u32 = 104;
    /// CHECK: something the attachment needs is missing or different.
    pub const CHECK_FAILED: u32 = 105;
    /// GC: some releases failed (details list them).
    pub const GC_INCOMPLETE: u32 = 106;
    /// ADD, DEL: the agent's network for this container and interface is
    /// not this attachment (another namespace), or the namespace already
    /// has an attachment (one per namespace); nothing was changed.
    pub const NOT_THIS_ATTACHMENT: u32 = 108;
    /// The container's namespace could not be configured.
    pub const NETNS: u32 = 107;
}

/// A CNI error: printed as `{cniVersion, code, msg, details}` on stdout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    pub fn to_json(&self, version: &str) -> Value {
        let mut o = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            o["details"] = Value::String(self.details.clone());
        }
        o
    }
}

/// The verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    pub fn parse(s: &str) -> Result<Self, CniError> {
        Ok(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            other => {
                return Err(CniError::new(
                    code::INVALID_ENV,
                    format!(
                        "CNI_COMMAND '{other}' is not one of ADD, DEL, CHECK, STATUS, GC, VERSION"
                    ),
                ));
            }
        })
    }

    /// The environment variables the spec requires for this verb.
    pub fn required_env(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => {
                &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"]
            }
            Command::Del => &["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"],
            Command::Gc => &["CNI_PATH"],
            Command::Status | Command::Version => &[],
        }
    }
}

/// One requested port mapping (`runtimeConfig.portMappings`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortMapping {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: String,
    pub host_ip: String,
}

/// The plugin's configuration (stdin), checked.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    /// D-Bus address of the agent's bus; None = the system bus.
    pub dbus_address: Option<String>,
    pub timeout_ms: u64,
    pub mtu: Option<u32>,
    pub allow_internet_access: Option<bool>,
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    /// `egressMode`: "dns" or "sni" (checked by the agent).
    pub egress_mode: Option<String>,
    pub dns: Option<Value>,
    pub port_mappings: Vec<PortMapping>,
    /// `runtimeConfig.bandwidth` (the `bandwidth` capability, as the
    /// reference plugin reads it: rates in bits/s, bursts in bits), here
    /// with the bursts in bytes as the agent takes them.
    pub bandwidth: crate::types::Bandwidth,
    pub prev_result: Option<Value>,
    /// GC: the attachments to keep, (container id, ifname).
    pub valid_attachments: Option<BTreeSet<(String, String)>>,
    /// `runtimeConfig.ips` (the `ips` capability): addresses the runtime
    /// asks the pod to have, as given ("192.168.0.50" or with a prefix).
    pub ips: Vec<String>,
}

pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;

/// Keys of the spec (and of runtimes) a plugin configuration may carry.
const SPEC_KEYS: &[&str] = &[
    "cniVersion",
    "cniVersions",
    "name",
    "type",
    "capabilities",
    "runtimeConfig",
    "args",
    "prevResult",
    "dns",
    "disableCheck",
    "disableGC",
];
/// cube-cni's own keys.
const PLUGIN_KEYS: &[&str] = &[
    "dbusAddress",
    "timeoutMs",
    "mtu",
    "allowInternetAccess",
    "allowOut",
    "denyOut",
    "egressMode",
];

fn config_err(msg: String) -> CniError {
    CniError::new(code::INVALID_CONFIG, msg)
}

/// Each item of the list `v` (the config key `key`) through `item`, which
/// gets the item's index for its error messages.
fn each<T, C: FromIterator<T>>(
    key: &str,
    v: &Value,
    item: impl FnMut((usize, &Value)) -> Result<T, CniError>,
) -> Result<C, CniError> {
    v.as_array()
        .ok_or_else(|| config_err(format!("{key}: must be a list")))?
        .iter()
        .enumerate()
        .map(item)
        .collect()
}

fn string_list(key: &str, v: &Value) -> Result<Vec<String>, CniError> {
    each(key, v, |(i, s)| {
        s.as_str()
            .map(str::to_owned)
            .ok_or_else(|| config_err(format!("{key}[{i}]: must be a string")))
    })
}

impl NetConf {
    /// Parses stdin. Decoding errors are code 6, bad values 7, an unknown
    /// key 2 (naming it and its value), an unsupported version 1.
    pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
        let v: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                code::DECODE,
                format!("the network configuration on stdin is not JSON: {e}"),
            )
        })?;
        let obj = v.as_object().ok_or_else(|| {
            CniError::new(
                code::DECODE,
                "the network configuration on stdin is not a JSON object",
            )
        })?;
        // A whole .conflist fed by hand: say what a runtime passes instead.
        if obj.contains_key("plugins") && !obj.contains_key("type") {
            return Err(CniError::new(
                code::UNSUPPORTED_FIELD,
                "this is a network configuration list (a .conflist with 'plugins'): a runtime \
                 passes each plugin one element of 'plugins' with the list's 'name' and \
                 'cniVersion' added, e.g. {\"cniVersion\":\"1.0.0\",\"name\":\"cube\",\
                 \"type\":\"cube-cni\"} (README, \"Using it from containerd\")",
            )
            .with_details("plugins"));
        }
        for (k, val) in obj {
            if !SPEC_KEYS.contains(&k.as_str())
                && !PLUGIN_KEYS.contains(&k.as_str())
                && !k.starts_with("cni.dev/")
            {
                let shown = serde_json::to_string(val).unwrap_or_default();
                return Err(CniError::new(
                    code::UNSUPPORTED_FIELD,
                    format!(
                        "unsupported field '{k}' (value {shown}); cube-cni knows {} and the \
                         spec's keys",
                        PLUGIN_KEYS.join(", ")
                    ),
                )
                .with_details(k.clone()));
            }
        }
        let cni_version = match obj.get("cniVersion") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(config_err("cniVersion: must be a string".into())),
            None => return Err(config_err("cniVersion: missing".into())),
        };
        if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "incompatible CNI versions; config is \"{cni_version}\", plugin supports {:?}",
                    SUPPORTED_VERSIONS
                ),
            ));
        }
        let name = match obj.get("name") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => return Err(config_err("name: missing or not a non-empty string".into())),
        };
        let dbus_address = match obj.get("dbusAddress") {
            None => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(_) => return Err(config_err("dbusAddress: must be a D-Bus address".into())),
        };
        let timeout_ms = match obj.get("timeoutMs") {
            None => DEFAULT_TIMEOUT_MS,
            Some(v) => match v.as_u64() {
                Some(n) if (1..=600_000).contains(&n) => n,
                _ => {
                    return Err(config_err(format!(
                        "timeoutMs: {v} is not a number of milliseconds in 1-600000"
                    )));
                }
            },
        };
        let mtu = match obj.get("mtu") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| config_err(format!("mtu: {v} is not an MTU")))?,
            ),
        };
        let allow_internet_access = match obj.get("allowInternetAccess") {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                return Err(config_err(format!(
                    "allowInternetAccess: {v} is not true or false"
                )));
            }
        };
        let allow_out = obj
            .get("allowOut")
            .map(|v| string_list("allowOut", v))
            .transpose()?
            .unwrap_or_default();
        let deny_out = obj
            .get("denyOut")
            .map(|v| string_list("denyOut", v))
            .transpose()?
            .unwrap_or_default();
        let egress_mode = match obj.get("egressMode") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => return Err(config_err(format!("egressMode: {v} is not a string"))),
        };
        let dns = obj.get("dns").cloned();
        let port_mappings = match obj.get("runtimeConfig").and_then(|r| r.get("portMappings")) {
            None | Some(Value::Null) => vec![],
            Some(v) => parse_port_mappings(v)?,
        };
        let bandwidth = match obj.get("runtimeConfig").and_then(|r| r.get("bandwidth")) {
            None | Some(Value::Null) => Default::default(),
            Some(v) => parse_bandwidth(v)?,
        };
        let ips = match obj.get("runtimeConfig").and_then(|r| r.get("ips")) {
            None | Some(Value::Null) => vec![],
            Some(v) => string_list("runtimeConfig.ips", v)?,
        };
        let prev_result = obj.get("prevResult").filter(|v| !v.is_null()).cloned();
        let valid_attachments = match obj.get("cni.dev/valid-attachments") {
            None => None,
            Some(v) => Some(parse_valid_attachments(v)?),
        };
        Ok(NetConf {
            cni_version,
            name,
            dbus_address,
            timeout_ms,
            mtu,
            allow_internet_access,
            allow_out,
            deny_out,
            egress_mode,
            dns,
            port_mappings,
            bandwidth,
            prev_result,
            valid_attachments,
            ips,
        })
    }
}

impl NetConf {
    /// What DEL needs of a configuration it could not parse whole: how to
    /// reach the agent (`dbusAddress`, `timeoutMs` where they are valid)
    /// and the version to answer in. A DEL must release the network it
    /// names whatever else its configuration says (a runtime that cannot
    /// DEL a pod retries it forever and wedges it), and it is identified
    /// by the environment (container id, ifname, netns), not by stdin.
    pub fn lenient(stdin: &[u8]) -> NetConf {
        let v: Value = serde_json::from_slice(stdin).unwrap_or(Value::Null);
        let str_of = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let cni_version = str_of("cniVersion")
            .filter(|s| SUPPORTED_VERSIONS.contains(&s.as_str()))
            .unwrap_or_else(|| "1.0.0".to_owned());
        NetConf {
            cni_version,
            name: str_of("name").unwrap_or_default(),
            dbus_address: str_of("dbusAddress"),
            timeout_ms: v
                .get("timeoutMs")
                .and_then(Value::as_u64)
                .filter(|n| (1..=600_000).contains(n))
                .unwrap_or(DEFAULT_TIMEOUT_MS),
            mtu: None,
            allow_internet_access: None,
            allow_out: vec![],
            deny_out: vec![],
            egress_mode: None,
            dns: None,
            port_mappings: vec![],
            bandwidth: Default::default(),
            prev_result: None,
            valid_attachments: None,
            ips: vec![],
        }
    }
}

/// A burst runtimes send when the pod sets none: Kubernetes and
/// containerd's "unset" is `math.MaxUint32` bits, the bandwidth plugin's
/// own ceiling `math.MaxInt32`. Read literally it is a 512 MiB bucket (a
/// 10 Mbit/s pod would send its first 512 MiB unshaped); it means "the
/// default burst".
pub const UNSET_BURSTS: [u64; 2] = [(1 << 31) - 1, (1 << 32) - 1];

/// `runtimeConfig.bandwidth`: `ingressRate`/`egressRate` (bits/s) and
/// `ingressBurst`/`egressBurst` (bits, turned into bytes); ingress is
/// what the container receives, egress what it sends. Keys are matched
/// as Go's JSON decoder matches them (case-insensitively: containerd
/// sends go-cni's untagged `IngressRate`, ...), and unknown keys are
/// ignored as the reference plugin ignores them; a known key with a value
/// the agent cannot honour is an error naming it.
fn parse_bandwidth(v: &Value) -> Result<crate::types::Bandwidth, CniError> {
    let key = "runtimeConfig.bandwidth";
    let o = v
        .as_object()
        .ok_or_else(|| config_err(format!("{key}: must be an object")))?;
    let mut b = crate::types::Bandwidth::default();
    for (k, n) in o {
        let field = match k.to_ascii_lowercase().as_str() {
            "ingressrate" => &mut b.ingress_bps,
            "egressrate" => &mut b.egress_bps,
            "ingressburst" => &mut b.ingress_burst,
            "egressburst" => &mut b.egress_burst,
            _ => continue,
        };
        if n.is_null() {
            continue;
        }
        let n = n.as_u64().ok_or_else(|| {
            config_err(format!(
                "{key}.{k}: {n} is not a whole number of bits (per second)"
            ))
        })?;
        *field = if k.to_ascii_lowercase().ends_with("burst") {
            if UNSET_BURSTS.contains(&n) {
                0
            } else {
                n.div_ceil(8)
            }
        } else {
            n
        };
    }
    // The reference plugin takes a burst without a rate as no limit.
    if b.ingress_bps == 0 {
        b.ingress_burst = 0;
    }
    if b.egress_bps == 0 {
        b.egress_burst = 0;
    }
    b.check()
        .map_err(|why| config_err(format!("{key}: {why}")))?;
    Ok(b)
}

fn parse_port_mappings(v: &Value) -> Result<Vec<PortMapping>, CniError> {
    let key = "runtimeConfig.portMappings";
    each(key, v, |(i, m)| {
        // containerd's CRI marshals go-cni's PortMapping, which has no
        // JSON tags: its keys arrive capitalised (HostPort, HostIP).
        let get = |field: &str| {
            m.as_object().and_then(|o| {
                o.iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(field))
                    .map(|(_, v)| v)
            })
        };
        let port = |field: &str| -> Result<u16, CniError> {
            let v = get(field).ok_or_else(|| config_err(format!("{key}[{i}].{field}: missing")))?;
            match v.as_u64() {
                Some(p) if (1..=65535).contains(&p) => Ok(p as u16),
                _ => Err(config_err(format!(
                    "{key}[{i}].{field}: {v} is not a port (1-65535)"
                ))),
            }
        };
        let protocol = match get("protocol") {
            None => "tcp".to_owned(),
            Some(Value::String(p)) => match p.to_ascii_lowercase().as_str() {
                p @ ("tcp" | "udp") => p.to_owned(),
                "sctp" => {
                    return Err(config_err(format!(
                        "{key}[{i}].protocol: sctp is not supported (tcp or udp)"
                    )));
                }
                _ => {
                    return Err(config_err(format!(
                        "{key}[{i}].protocol: '{p}' is not tcp or udp"
                    )));
                }
            },
            Some(v) => {
                return Err(config_err(format!(
                    "{key}[{i}].protocol: {v} is not a string"
                )));
            }
        };
        let host_ip = match get("hostIP") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(config_err(format!(
                    "{key}[{i}].hostIP: {v} is not a string"
                )));
            }
        };
        Ok(PortMapping {
            host_port: port("hostPort")?,
            container_port: port("containerPort")?,
            protocol,
            host_ip,
        })
    })
}

fn parse_valid_attachments(v: &Value) -> Result<BTreeSet<(String, String)>, CniError> {
    let key = "cni.dev/valid-attachments";
    each(key, v, |(i, a)| {
        let field = |f: &str| {
            a.get(f)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| config_err(format!("{key}[{i}].{f}: missing or not a string")))
        };
        Ok((field("containerID")?, field("ifname")?))
    })
}

/// `CNI_CONTAINERID` as the spec defines it: at least one character of
/// `[A-Za-z0-9_.-]`, starting with a letter or digit.
pub fn validate_container_id(id: &str) -> Result<(), CniError> {
    let bad = |why: &str| {
        Err(CniError::new(
            code::INVALID_ENV,
            format!("CNI_CONTAINERID '{id}' {why}"),
        ))
    };
    if !id.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return bad("must start with a letter or digit");
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return bad(&format!(
            "contains {c:?}: container ids are letters, digits, '_', '.' and '-'"
        ));
    }
    Ok(())
}

/// The agent's sandbox id of an attachment: `cni:<container id>:<ifname>`,
/// injective in (container id, ifname). A container id has no ':'; the
/// ifname keeps `[A-Za-z0-9_-]` and writes every other byte as `.xx`
/// (hex), so `.` only ever starts an escape. `cni:` ids are reserved for
/// CNI attachments (the agent refuses them for TAP networks), and the same
/// (container id, ifname) always gives the same id, so DEL, CHECK and GC
/// need no state of their own. Ids are at most 128 bytes: container ids up
/// to 78 bytes always fit (containerd, CRI-O and podman use 64).
pub fn sandbox_id(container_id: &str, ifname: &str) -> Result<String, CniError> {
    validate_container_id(container_id)?;
    let mut id = format!("{}{container_id}:", crate::agent::spec::CNI_ID_PREFIX);
    for b in ifname.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            id.push(b as char);
        } else {
            id.push_str(&format!(".{b:02x}"));
        }
    }
    if id.len() > crate::agent::spec::MAX_ID_LEN {
        return Err(CniError::new(
            code::INVALID_ENV,
            format!(
                "CNI_CONTAINERID is {} bytes: with CNI_IFNAME '{ifname}' the attachment's id \
                 would be {} bytes, the agent's limit is {}",
                container_id.len(),
                id.len(),
                crate::agent::spec::MAX_ID_LEN
            ),
        ));
    }
    Ok(id)
}

/// The id earlier releases gave an attachment (`cni-<container id>-<ifname>`,
/// or a hash when that did not fit): DEL and CHECK still find networks
/// made before the injective ids, and act on them only if their recorded
/// container id, ifname and namespace match.
pub fn legacy_sandbox_id(container_id: &str, ifname: &str) -> String {
    let plain = format!("cni-{container_id}-{ifname}");
    let ok = plain.len() <= 128
        && plain
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
    if ok {
        return plain;
    }
    // FNV-1a, two lanes of 64 bits: stable across releases and platforms.
    let lane = |seed: u64| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
        for b in container_id
            .bytes()
            .chain(std::iter::once(0))
            .chain(ifname.bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    };
    format!("cni-{:016x}{:016x}", lane(0), lane(0x9e37_79b9_7f4a_7c15))
}

/// Metadata keys the plugin records on each network.
pub const META_NETWORK: &str = "cni.network";
pub const META_CONTAINER_ID: &str = "cni.container_id";
pub const META_IFNAME: &str = "cni.ifname";
pub const META_NETNS: &str = "cni.netns";

/// What the result needs from the agent's network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetFacts {
    pub host_ifname: String,
    pub sandbox_ip: String,
    /// CIDR, e.g. 169.254.68.6/30.
    pub guest_ip: String,
    pub gateway_ip: String,
    pub guest_mac: String,
    pub mtu: u32,
    /// The guests' IPv6 link is on (the agent's `guest_ipv6`, the guests'
    /// /64): the container gets its SLAAC address (`container_ipv6`) at
    /// once and its IPv6 default route from the gateway's Router
    /// Advertisements, as a VM guest does.
    pub guest_ipv6: Option<String>,
    /// The sandbox's IPv6 reaches the world (the agent's `ipv6_egress`):
    /// the container gets an IPv6 default route from the RA.
    pub ipv6_egress: bool,
    /// The sandbox's node-side IPv6 identity (the agent's `sandbox_ipv6`):
    /// the pod's IPv6, as `sandbox_ip` is its IPv4.
    pub sandbox_ipv6: Option<String>,
    /// The gateway's link-local address (the agent's `gateway_ipv6`).
    pub gateway_ipv6: Option<String>,
}

impl NetFacts {
    /// The container's IPv6 address: what SLAAC makes of its MAC in the
    /// guests' /64 (the one a VM guest configured by RA has, and the one
    /// port mappings reach).
    pub fn container_ipv6(&self) -> Option<std::net::Ipv6Addr> {
        let prefix = self
            .guest_ipv6
            .as_deref()?
            .split('/')
            .next()?
            .parse()
            .ok()?;
        let mac = crate::config::parse_mac(&self.guest_mac)?;
        Some(crate::types::eui64(prefix, &mac))
    }
}

fn version_at_least(v: &str, major: u32, minor: u32) -> bool {
    let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (a, b) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

/// The ADD result in `version`: the host end and the container interface;
/// the pod IP (sandbox address, /32, no interface: assigned outside the
/// container, reachable from the host) first, then the container's own
/// address with its gateway; the default route; `dns` from the config.
pub fn result(
    version: &str,
    facts: &NetFacts,
    ifname: &str,
    netns: &str,
    dns: &Option<Value>,
) -> Value {
    let new = version_at_least(version, 1, 0);
    let mut container = json!({"name": ifname, "mac": facts.guest_mac, "sandbox": netns});
    if version_at_least(version, 1, 1) {
        container["mtu"] = json!(facts.mtu);
    }
    let ip = |address: &str, gateway: Option<&str>, interface: Option<u32>| {
        let mut o = Map::new();
        if !new {
            let v6 = address.contains(':');
            o.insert("version".into(), json!(if v6 { "6" } else { "4" }));
        }
        o.insert("address".into(), json!(address));
        if let Some(g) = gateway {
            o.insert("gateway".into(), json!(g));
        }
        if let Some(i) = interface {
            o.insert("interface".into(), json!(i));
        }
        Value::Object(o)
    };
    let mut r = json!({
        "cniVersion": version,
        "interfaces": [{"name": facts.host_ifname}, container],
        "ips": [
            ip(&format!("{}/32", facts.sandbox_ip), None, None),
            ip(&facts.guest_ip, Some(&facts.gateway_ip), Some(1)),
        ],
        "routes": [{"dst": "0.0.0.0/0", "gw": facts.gateway_ip}],
    });
    // Both families where the node reaches the sandbox over IPv6 too: the
    // pod's IPv6 (node-unique, no interface) before the container's own
    // (the same in every container), so CRI takes the former.
    if let (Some(sb6), Some(c6), Some(gw6)) = (
        &facts.sandbox_ipv6,
        facts.container_ipv6(),
        &facts.gateway_ipv6,
    ) {
        let ips = r["ips"].as_array_mut().expect("ips");
        ips.push(ip(&format!("{sb6}/128"), None, None));
        ips.push(ip(&format!("{c6}/64"), Some(gw6), Some(1)));
        if facts.ipv6_egress {
            let routes = r["routes"].as_array_mut().expect("routes");
            routes.push(json!({"dst": "::/0", "gw": gw6}));
        }
    }
    r["dns"] = dns.clone().unwrap_or_else(|| json!({}));
    r
}

/// The result's `dns`: the config's, and for an attachment with domain
/// rules the agent's resolver (`resolver`, the gateway address) as the
/// nameserver when the config names none (docs/egress.md).
pub fn dns_for(config: &Option<Value>, resolver: Option<&str>) -> Option<Value> {
    let Some(resolver) = resolver else {
        return config.clone();
    };
    let mut d = config.clone().unwrap_or_else(|| json!({}));
    let named = d
        .get("nameservers")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    if !named && d.is_object() {
        d["nameservers"] = json!([resolver]);
    }
    Some(d)
}

/// The VERSION answer.
pub fn version_info(input_version: Option<&str>) -> Value {
    json!({
        "cniVersion": input_version.unwrap_or("1.1.0"),
        "supportedVersions": SUPPORTED_VERSIONS,
    })
}

/// `CNI_ARGS` (`K=V;K=V`): the Kubernetes pod identity, if given, for the
/// network's metadata. Other keys are ignored (as every reference plugin
/// does with `IgnoreUnknown`).
pub fn args_metadata(cni_args: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for kv in cni_args.split(';') {
        let Some((k, v)) = kv.split_once('=') else {
            continue;
        };
        let key = match k {
            "K8S_POD_NAMESPACE" => "k8s.pod_namespace",
            "K8S_POD_NAME" => "k8s.pod_name",
            "K8S_POD_UID" => "k8s.pod_uid",
            _ => continue,
        };
        if !v.is_empty() && v.len() <= 253 {
            out.insert(key.to_owned(), v.to_owned());
        }
    }
    out
}

/// The pod addresses a runtime asks for: `runtimeConfig.ips` (the `ips`
/// capability; podman with more than one address) and the `IP` of
/// `CNI_ARGS` (the convention of the static IPAM plugin, comma separated;
/// podman's single `--ip`), each an address or an address with a prefix
/// (the prefix is the runtime's view of a subnet: the pod address is a
/// /32 here). At most one per family: the IPv4 one is the sandbox
/// address, the IPv6 one must be the identity that follows from it (the
/// agent checks both). A value that is no address is error 7 naming it:
/// never ignored.
pub fn requested_ips(
    ips: &[String],
    cni_args: &str,
) -> Result<(Option<std::net::Ipv4Addr>, Option<std::net::Ipv6Addr>), CniError> {
    let from_args = cni_args
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == "IP")
        .flat_map(|(_, v)| v.split(','))
        .filter(|v| !v.is_empty())
        .map(|v| ("CNI_ARGS IP", v.to_owned()));
    let all = ips
        .iter()
        .map(|v| ("runtimeConfig.ips", v.clone()))
        .chain(from_args);
    let (mut v4, mut v6) = (None, None);
    for (from, raw) in all {
        let addr = raw.split_once('/').map_or(raw.as_str(), |(a, _)| a);
        let bad = |why: &str| config_err(format!("{from}: '{raw}' {why}"));
        match addr.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V4(a)) => match v4 {
                Some(b) if b != a => {
                    return Err(bad(&format!(
                        "is a second IPv4 address ({b} was asked for): a pod has one"
                    )));
                }
                _ => v4 = Some(a),
            },
            Ok(std::net::IpAddr::V6(a)) => match v6 {
                Some(b) if b != a => {
                    return Err(bad(&format!(
                        "is a second IPv6 address ({b} was asked for): a pod has one"
                    )));
                }
                _ => v6 = Some(a),
            },
            Err(_) => return Err(bad("is not an IP address")),
        }
    }
    Ok((v4, v6))
}

/// The agent's D-Bus error (its name's last component and message) as a
/// CNI error.
pub fn agent_error(name: &str, msg: &str) -> CniError {
    let short = name.rsplit('.').next().unwrap_or(name);
    let c = match short {
        "InvalidArgument" => code::INVALID_CONFIG,
        "NotFound" => code::NOT_FOUND,
        "NodeFull" | "LimitsExceeded" | "ServiceUnknown" | "NameHasNoOwner" | "NoReply"
        | "Timeout" | "TimedOut" => code::TRY_AGAIN_LATER,
        "PortInUse" => code::PORT_IN_USE,
        "Conflict" => code::NOT_THIS_ATTACHMENT,
        "AccessDenied" | "InteractiveAuthorizationRequired" => code::ACCESS_DENIED,
        _ => code::AGENT_FAILED,
    };
    CniError::new(c, format!("cube-network-agent: {msg}")).with_details(name.to_owned())
}

/// STATUS from Health's checks: `None` = ready. An address pool with no
/// free address, or a store that cannot write, only stops new ADDs (50);
/// a datapath, uplink or gateway problem also hurts the containers that
/// run (51) when there are any.
pub fn status_verdict(checks: &[(String, bool, String)], active_networks: u32) -> Option<CniError> {
    let failed: Vec<&(String, bool, String)> = checks.iter().filter(|c| !c.1).collect();
    if failed.is_empty() {
        return None;
    }
    let list = failed
        .iter()
        .map(|(n, _, d)| format!("{n}: {d}"))
        .collect::<Vec<_>>()
        .join("; ");
    let connectivity = failed
        .iter()
        .any(|(n, _, _)| n.starts_with("datapath") || n == "uplink" || n == "gateway_device");
    let c = if connectivity && active_networks > 0 {
        code::LIMITED_CONNECTIVITY
    } else {
        code::NOT_READY
    };
    Some(CniError::new(
        c,
        format!("cube-network-agent is not healthy: {list}"),
    ))
}

/// GC: the networks of `network` to release, given each network's
/// (sandbox id, metadata). Networks without CNI metadata (made by VMM
/// launchers over D-Bus or varlink) and those of other CNI networks are
/// never chosen.
pub fn gc_victims(
    network: &str,
    valid: &BTreeSet<(String, String)>,
    networks: &[(String, BTreeMap<String, String>)],
) -> Vec<(String, HashMap<String, String>)> {
    networks
        .iter()
        .filter(|(_, m)| m.get(META_NETWORK).map(String::as_str) == Some(network))
        .filter_map(|(id, m)| {
            let (c, i) = (m.get(META_CONTAINER_ID)?, m.get(META_IFNAME)?);
            (!valid.contains(&(c.clone(), i.clone()))).then(|| {
                // What the release must find unchanged.
                let expect = [
                    (META_NETWORK, network),
                    (META_CONTAINER_ID, c.as_str()),
                    (META_IFNAME, i.as_str()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
                (id.clone(), expect)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(extra: &str) -> Result<NetConf, CniError> {
        NetConf::parse(
            format!(r#"{{"cniVersion":"1.0.0","name":"cube","type":"cube-cni"{extra}}}"#)
                .as_bytes(),
        )
    }

    /// `runtimeConfig.bandwidth` as runtimes send it: containerd's CRI
    /// marshals go-cni's untagged struct (`IngressRate`, ...) and sends
    /// 2^32-1 for a burst the pod did not set (issue 51).
    #[test]
    fn bandwidth_keys_as_go_decodes_them() {
        let bw = |b: &str| conf(&format!(r#","runtimeConfig":{{"bandwidth":{b}}}"#));
        let b = bw(r#"{"IngressRate":10000000,"IngressBurst":4294967295,
            "EgressRate":10000000,"EgressBurst":4294967295}"#)
        .unwrap()
        .bandwidth;
        assert_eq!((b.ingress_bps, b.egress_bps), (10_000_000, 10_000_000));
        assert_eq!((b.ingress_burst, b.egress_burst), (0, 0), "unset = default");
        let b = bw(
            r#"{"egressrate":8000,"EGRESSBURST":2147483647,"ingressRate":9000,
            "ingressBurst":16000,"Extra":"x","latency":5}"#,
        )
        .unwrap()
        .bandwidth;
        assert_eq!((b.egress_bps, b.egress_burst), (8000, 0));
        assert_eq!((b.ingress_bps, b.ingress_burst), (9000, 2000));
        // A known key the agent cannot honour is refused, naming it.
        let e = bw(r#"{"EgressRate":"10M"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        assert!(
            e.msg.contains("runtimeConfig.bandwidth.EgressRate"),
            "{}",
            e.msg
        );
        let e = bw(r#"{"EgressRate":10}"#).unwrap_err();
        assert!(e.msg.contains("egress_bps"), "{}", e.msg);
        let e = bw(r#"{"IngressRate":10000000,"IngressBurst":68719476736}"#).unwrap_err();
        assert!(e.msg.contains("ingress_burst"), "{}", e.msg);
    }

    /// DEL keeps what it needs of a configuration it cannot parse.
    #[test]
    fn lenient_keeps_the_way_to_the_agent() {
        let c = NetConf::lenient(
            br#"{"cniVersion":"0.4.0","name":"cube","dbusAddress":"unix:path=/x",
                "timeoutMs":500,"runtimeConfig":{"bandwidth":{"EgressRate":"bad"}},"bogus":1}"#,
        );
        assert_eq!(c.cni_version, "0.4.0");
        assert_eq!(c.dbus_address.as_deref(), Some("unix:path=/x"));
        assert_eq!(c.timeout_ms, 500);
        let c = NetConf::lenient(b"not json");
        assert_eq!((c.cni_version.as_str(), c.dbus_address), ("1.0.0", None));
        assert_eq!(c.timeout_ms, DEFAULT_TIMEOUT_MS);
    }

    /// Every key cube-cni takes is in its man page and in README.
    #[test]
    fn plugin_keys_are_documented() {
        let man = include_str!("../../man/cube-cni.8");
        let readme = include_str!("../../README.md");
        for k in PLUGIN_KEYS {
            assert!(man.contains(k), "{k} missing from man/cube-cni.8");
            assert!(
                readme.contains(&format!("`{k}`")),
                "{k} missing from README"
            );
        }
    }

    #[test]
    fn config_errors_carry_spec_codes() {
        assert_eq!(NetConf::parse(b"{").unwrap_err().code, code::DECODE);
        assert_eq!(NetConf::parse(b"[]").unwrap_err().code, code::DECODE);
        let e = conf(r#","bridge":"br0""#).unwrap_err();
        assert_eq!(e.code, code::UNSUPPORTED_FIELD);
        assert!(
            e.msg.contains("'bridge'") && e.msg.contains("\"br0\""),
            "{e:?}"
        );
        // The shipped .conflist fed by hand: what to pass instead.
        let e = NetConf::parse(include_bytes!("../../examples/cni/10-cube.conflist")).unwrap_err();
        assert_eq!(e.code, code::UNSUPPORTED_FIELD);
        assert!(
            e.msg.contains("network configuration list") && e.msg.contains(r#""type":"cube-cni""#),
            "{e:?}"
        );
        let e = NetConf::parse(br#"{"cniVersion":"2.0.0","name":"x"}"#).unwrap_err();
        assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
        let e = NetConf::parse(br#"{"cniVersion":"1.0.0"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        let e = conf(r#","timeoutMs":0"#).unwrap_err();
        assert!(e.msg.starts_with("timeoutMs"), "{e:?}");
        let e = conf(r#","runtimeConfig":{"portMappings":[{"hostPort":0,"containerPort":80}]}"#)
            .unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        assert!(e.msg.contains("portMappings[0].hostPort"), "{e:?}");
        let e = conf(
            r#","runtimeConfig":{"portMappings":[{"hostPort":80,"containerPort":80,"protocol":"sctp"}]}"#,
        )
        .unwrap_err();
        assert!(e.msg.contains("sctp"), "{e:?}");
    }

    /// podman sends one `--ip` as `IP=` in CNI_ARGS and several in
    /// `runtimeConfig.ips`; neither is ever ignored.
    #[test]
    fn requested_ips_from_both_channels() {
        let c = conf(r#","runtimeConfig":{"ips":["192.168.0.50/18","fd63:7562:6501::c0a8:32"]}"#)
            .unwrap();
        let (v4, v6) = requested_ips(&c.ips, "IgnoreUnknown=1;K8S_POD_NAME=x").unwrap();
        assert_eq!(v4, Some("192.168.0.50".parse().unwrap()));
        assert_eq!(v6, Some("fd63:7562:6501::c0a8:32".parse().unwrap()));
        let (v4, v6) = requested_ips(&[], "IgnoreUnknown=1;K8S_POD_NAME=x;IP=192.168.0.9").unwrap();
        assert_eq!((v4, v6), (Some("192.168.0.9".parse().unwrap()), None));
        assert_eq!(requested_ips(&[], "IgnoreUnknown=1").unwrap(), (None, None));
        let e = requested_ips(&["10.0.0.1".into()], "IP=10.0.0.2").unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        assert!(
            e.msg.contains("'10.0.0.2'") && e.msg.contains("10.0.0.1"),
            "{}",
            e.msg
        );
        let e = requested_ips(&["nope".into()], "").unwrap_err();
        assert!(e.msg.contains("runtimeConfig.ips: 'nope'"), "{}", e.msg);
        let e = conf(r#","runtimeConfig":{"ips":"10.0.0.1"}"#).unwrap_err();
        assert!(e.msg.contains("runtimeConfig.ips"), "{}", e.msg);
    }

    #[test]
    fn cri_port_mappings_with_go_field_names() {
        let c = conf(
            r#","runtimeConfig":{"portMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":"udp","HostIP":""}]}"#,
        )
        .unwrap();
        assert_eq!(
            c.port_mappings,
            vec![PortMapping {
                host_port: 8080,
                container_port: 80,
                protocol: "udp".into(),
                host_ip: String::new()
            }]
        );
    }

    #[test]
    fn config_reads_everything() {
        let c = conf(
            r#","cniVersions":["1.0.0","1.1.0"],"dbusAddress":"unix:path=/x","timeoutMs":500,
            "mtu":1400,"allowInternetAccess":false,"allowOut":["10.0.0.0/8"],"denyOut":["1.1.1.1"],
            "capabilities":{"portMappings":true},
            "runtimeConfig":{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"TCP","hostIP":"127.0.0.1"}]},
            "cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}],
            "prevResult":null,"dns":{"nameservers":["10.0.0.53"]}"#,
        )
        .unwrap();
        assert_eq!(c.dbus_address.as_deref(), Some("unix:path=/x"));
        assert_eq!(c.timeout_ms, 500);
        assert_eq!(c.mtu, Some(1400));
        assert_eq!(c.allow_internet_access, Some(false));
        assert_eq!(c.port_mappings[0].protocol, "tcp");
        assert_eq!(c.port_mappings[0].host_ip, "127.0.0.1");
        assert!(c.prev_result.is_none());
        assert!(
            c.valid_attachments
                .unwrap()
                .contains(&("a".into(), "eth0".into()))
        );
    }

    #[test]
    fn sandbox_ids_are_injective_and_valid() {
        assert_eq!(sandbox_id("abc", "eth0").unwrap(), "cni:abc:eth0");
        // The collisions of the old "cni-<id>-<ifname>" scheme.
        assert_ne!(
            sandbox_id("my", "app-eth0").unwrap(),
            sandbox_id("my-app", "eth0").unwrap()
        );
        assert_ne!(
            sandbox_id("a", "b.c").unwrap(),
            sandbox_id("a.b", "c").unwrap()
        );
        // Bytes outside the id charset are escaped, '.' included.
        assert_eq!(sandbox_id("c1", "e.1").unwrap(), "cni:c1:e.2e1");
        assert_eq!(sandbox_id("c1", "e+1").unwrap(), "cni:c1:e.2b1");
        assert_ne!(
            sandbox_id("c1", "e.2e1").unwrap(),
            sandbox_id("c1", "e.1").unwrap()
        );
        // Every id the plugin makes is a valid sandbox id.
        for (c, i) in [("x", "eth0"), ("0-a_b.c", "veth@1"), ("z", "\u{e9}th")] {
            crate::agent::spec::validate_sandbox_id(&sandbox_id(c, i).unwrap()).unwrap();
        }
        // 64-hex container ids (containerd, CRI-O, podman) fit with any ifname.
        let hex = "f".repeat(64);
        assert!(sandbox_id(&hex, &"+".repeat(15)).is_ok());
        let e = sandbox_id(&"f".repeat(200), "eth0").unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV);
        assert!(e.msg.contains("128"), "{}", e.msg);
        for bad in ["", "-a", ".a", "a:b", "a/b", "a b"] {
            let e = sandbox_id(bad, "eth0").unwrap_err();
            assert_eq!(e.code, code::INVALID_ENV, "{bad}: {}", e.msg);
            assert!(e.msg.contains("CNI_CONTAINERID"), "{}", e.msg);
        }
        assert_eq!(legacy_sandbox_id("abc", "eth0"), "cni-abc-eth0");
    }

    fn facts() -> NetFacts {
        NetFacts {
            host_ifname: "ctapc0a80002".into(),
            sandbox_ip: "192.168.0.2".into(),
            guest_ip: "169.254.68.6/30".into(),
            gateway_ip: "169.254.68.5".into(),
            guest_mac: "20:90:6f:fc:fc:fc".into(),
            mtu: 1300,
            guest_ipv6: None,
            ipv6_egress: false,
            sandbox_ipv6: None,
            gateway_ipv6: None,
        }
    }

    #[test]
    fn results_per_version() {
        let r = result("1.1.0", &facts(), "eth0", "/run/netns/x", &None);
        assert_eq!(r["interfaces"][1]["mtu"], 1300);
        assert_eq!(r["interfaces"][1]["sandbox"], "/run/netns/x");
        assert_eq!(r["ips"][0]["address"], "192.168.0.2/32");
        assert!(r["ips"][0].get("interface").is_none());
        assert_eq!(r["ips"][1]["interface"], 1);
        assert_eq!(r["ips"][1]["gateway"], "169.254.68.5");
        assert!(r["ips"][1].get("version").is_none());
        let r = result("1.0.0", &facts(), "eth0", "/n", &None);
        assert!(r["interfaces"][1].get("mtu").is_none());
        let r = result(
            "0.4.0",
            &facts(),
            "eth0",
            "/n",
            &Some(json!({"nameservers":["1.1.1.1"]})),
        );
        assert_eq!(r["ips"][0]["version"], "4");
        assert_eq!(r["dns"]["nameservers"][0], "1.1.1.1");
        // No IPv6 entry without a node-side IPv6 identity: the
        // container's address is the same in every container, and CRI
        // would take it as the pod's IPv6 (docs/cni.md "Pod IP").
        let mut f = facts();
        f.guest_ipv6 = Some("fd63:7562:6500::6/64".into());
        f.gateway_ipv6 = Some("fe80::2290:6fff:fecf:cfcf".into());
        f.ipv6_egress = true;
        assert_eq!(
            f.container_ipv6().unwrap().to_string(),
            "fd63:7562:6500:0:2290:6fff:fefc:fcfc"
        );
        let r = result("1.1.0", &f, "eth0", "/n", &None);
        assert_eq!(r["ips"].as_array().unwrap().len(), 2);
        assert_eq!(r["routes"].as_array().unwrap().len(), 1);
        // With one: the pod's IPv6 (no interface) before the container's,
        // the IPv6 default route where the sandbox has NAT66.
        f.sandbox_ipv6 = Some("fd63:7562:6501::c0a8:2".into());
        for v in ["1.1.0", "0.4.0"] {
            let r = result(v, &f, "eth0", "/n", &None);
            let ips = r["ips"].as_array().unwrap();
            assert_eq!(ips.len(), 4, "{r}");
            assert_eq!(ips[2]["address"], "fd63:7562:6501::c0a8:2/128");
            assert!(ips[2].get("interface").is_none());
            assert_eq!(ips[3]["address"], "fd63:7562:6500:0:2290:6fff:fefc:fcfc/64");
            assert_eq!(ips[3]["gateway"], "fe80::2290:6fff:fecf:cfcf");
            assert_eq!(ips[3]["interface"], 1);
            assert_eq!(ips[2].get("version").is_some(), v == "0.4.0");
            if v == "0.4.0" {
                assert_eq!(ips[2]["version"], "6");
                assert_eq!(ips[0]["version"], "4");
            }
            assert_eq!(
                r["routes"][1],
                json!({"dst": "::/0", "gw": "fe80::2290:6fff:fecf:cfcf"})
            );
        }
        f.ipv6_egress = false;
        let r = result("1.1.0", &f, "eth0", "/n", &None);
        assert_eq!(r["ips"].as_array().unwrap().len(), 4);
        assert_eq!(r["routes"].as_array().unwrap().len(), 1);
        // Domain rules: the resolver, unless the config names servers.
        let ours = dns_for(&None, Some("169.254.68.5")).unwrap();
        assert_eq!(ours, json!({"nameservers": ["169.254.68.5"]}));
        let search = Some(json!({"search": ["svc.local"]}));
        assert_eq!(
            dns_for(&search, Some("169.254.68.5")).unwrap(),
            json!({"search": ["svc.local"], "nameservers": ["169.254.68.5"]})
        );
        let theirs = Some(json!({"nameservers": ["10.0.0.53"]}));
        assert_eq!(dns_for(&theirs, Some("169.254.68.5")), theirs);
        assert_eq!(dns_for(&theirs, None), theirs);
    }

    #[test]
    fn status_and_gc_rules() {
        let ok = vec![("store".to_string(), true, String::new())];
        assert!(status_verdict(&ok, 3).is_none());
        let addr = vec![("addresses".to_string(), false, "0 of 10 free".to_string())];
        assert_eq!(status_verdict(&addr, 3).unwrap().code, code::NOT_READY);
        let dp = vec![("datapath_filters".to_string(), false, "x".to_string())];
        assert_eq!(
            status_verdict(&dp, 3).unwrap().code,
            code::LIMITED_CONNECTIVITY
        );
        assert_eq!(status_verdict(&dp, 0).unwrap().code, code::NOT_READY);

        let meta = |net: &str, c: &str| {
            BTreeMap::from([
                (META_NETWORK.to_string(), net.to_string()),
                (META_CONTAINER_ID.to_string(), c.to_string()),
                (META_IFNAME.to_string(), "eth0".to_string()),
            ])
        };
        let nets = vec![
            ("cni-a-eth0".to_string(), meta("cube", "a")),
            ("cni-b-eth0".to_string(), meta("cube", "b")),
            ("cni-c-eth0".to_string(), meta("other", "c")),
            ("vm-1".to_string(), BTreeMap::new()),
        ];
        let valid = BTreeSet::from([("a".to_string(), "eth0".to_string())]);
        let ids = |v: Vec<(String, HashMap<String, String>)>| {
            v.into_iter().map(|(id, _)| id).collect::<Vec<_>>()
        };
        assert_eq!(ids(gc_victims("cube", &valid, &nets)), vec!["cni-b-eth0"]);
        assert_eq!(
            ids(gc_victims("cube", &BTreeSet::new(), &nets)),
            vec!["cni-a-eth0", "cni-b-eth0"]
        );
        // Each victim is released only if it is still that attachment.
        let (_, expect) = &gc_victims("cube", &valid, &nets)[0];
        let expect: BTreeMap<_, _> = expect.clone().into_iter().collect();
        assert_eq!(expect, meta("cube", "b"));
    }

    #[test]
    fn agent_errors_map_to_codes() {
        assert_eq!(
            agent_error("org.cube.NetworkAgent.Error.PortInUse", "x").code,
            code::PORT_IN_USE
        );
        assert_eq!(
            agent_error("org.cube.NetworkAgent.Error.NodeFull", "x").code,
            code::TRY_AGAIN_LATER
        );
        assert_eq!(
            agent_error("org.freedesktop.DBus.Error.AccessDenied", "x").code,
            code::ACCESS_DENIED
        );
        assert_eq!(
            agent_error("org.cube.NetworkAgent.Error.Failed", "x").code,
            code::AGENT_FAILED
        );
    }
}
