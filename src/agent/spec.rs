//! What a caller asks for (`NetworkSpec`), what is stored
//! (`NetworkRecord`), and the rules both must follow. Pure code.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use super::AgentError;
use crate::alloc::ip::{Cidr, CidrError};
use crate::alloc::{Ipv4Cidr, Ipv6Cidr};
use crate::config::{MAX_MTU, MIN_MTU};
pub use crate::types::{Bandwidth, NetnsFd, NetnsId, PortMapping};

pub const MAX_ID_LEN: usize = 128;
pub const MAX_PORT_MAPPINGS: usize = 64;
pub const MAX_CIDRS: usize = 256;
pub const MAX_METADATA: usize = 64;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 1024;
pub const MAX_IDEMPOTENCY_KEY: usize = 128;
pub const RECORD_VERSION: u32 = 1;

/// `sandbox_id`: 1-128 chars of `[A-Za-z0-9_.:-]`, not starting with `.` or `-`.
pub fn validate_sandbox_id(id: &str) -> Result<(), AgentError> {
    let bad = |why: &str| Err(AgentError::InvalidArgument(format!("sandbox_id: {why}")));
    if id.is_empty() {
        return bad("must not be empty");
    }
    if id.len() > MAX_ID_LEN {
        return bad(&format!(
            "is {} bytes long, the limit is {MAX_ID_LEN}",
            id.len()
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return bad(&format!(
            "character {c:?} is not allowed (use A-Z a-z 0-9 _ . : -)"
        ));
    }
    if id.starts_with(['.', '-']) {
        return bad("must not start with '.' or '-'");
    }
    Ok(())
}

/// A validated request (EnsureNetwork options), every field explicit:
/// EnsureNetwork is declarative, so an omitted option means its default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetworkSpec {
    pub port_mappings: Vec<PortMapping>,
    pub allow_internet_access: Option<bool>,
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub idempotency_key: Option<String>,
    pub mtu: Option<u32>,
    /// What carries the sandbox's traffic on the host (default: a TAP).
    pub attach: Attach,
    /// How names in `allow_out`/`deny_out` are enforced (default: DNS).
    pub egress_mode: EgressMode,
    /// Bandwidth limits; a rate of 0 (or absent) means the node's default
    /// (`default_egress_rate`/`default_ingress_rate`, unlimited unless set).
    pub bandwidth: Bandwidth,
    /// A new network takes this sandbox's spec (port mappings with fresh
    /// host ports, policy, egress rules, MTU, limits): a clone restored
    /// from a snapshot of it. Only `metadata` and `idempotency_key` may
    /// come with it.
    pub clone_of: Option<String>,
    /// The sandbox's VM is paused: packets for it are dropped, and the
    /// first one of each pause is reported (`TrafficWhilePaused`).
    pub paused: bool,
    /// `tap_owner_uid`/`tap_owner_gid`: the TAP is handed over by name to
    /// a VMM running as this uid (and group), not by fd (see
    /// [`TapOwner`]). As given: [`NetworkSpec::validated`] checks them.
    pub tap_owner_uid: Option<u32>,
    pub tap_owner_gid: Option<u32>,
    /// `mapping_wins`: the network's port mappings win over host sockets
    /// that bind their ports after the mapping was made (portmap's order:
    /// a container runtime that holds the published port itself, rootful
    /// podman's conmon). Only for veth attachments (CNI); docs/datapath.md
    /// "Port mappings and host sockets".
    pub mapping_wins: bool,
    /// `sandbox_ip`/`sandbox_ipv6`: the caller asks for this sandbox
    /// address (CNI's `ips` capability, podman's `--ip`); an IPv6 one must
    /// be the node-side identity that follows from the IPv4 address. A new
    /// network gets it or fails; an existing one must have it.
    pub sandbox_ip: Option<Ipv4Addr>,
    pub sandbox_ipv6: Option<std::net::Ipv6Addr>,
    /// `egress_rules`: per host, headers the agent sets on the sandbox's
    /// requests and the methods and paths allowed (docs/egress.md "Egress
    /// rules"). Their hosts are reachable as allow_out names are.
    pub egress_rules: Vec<crate::rules::EgressRule>,
}

/// Who may attach to a TAP handed over by name: the kernel lets a process
/// attach (TUNSETIFF) to a persistent TAP only if its euid is `uid` and,
/// when `gid` is set, it is in that group, or if it has CAP_NET_ADMIN.
/// The agent holds no fd of such a TAP (docs/design.md, "TAPs handed over
/// by name").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapOwner {
    pub uid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

impl std::fmt::Display for TapOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.gid {
            Some(g) => write!(f, "uid {} gid {g}", self.uid),
            None => write!(f, "uid {}", self.uid),
        }
    }
}

/// How a sandbox's egress by name is enforced (docs/egress.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EgressMode {
    /// The agent's resolver learns the addresses of allowed names; new
    /// flows may go to those (and to allowed CIDRs).
    #[default]
    Dns,
    /// DNS mode, and TCP to ports 80 and 443 goes through the agent's
    /// proxy, which checks the TLS SNI or HTTP Host and dials the name
    /// itself; UDP to 443 (QUIC) is dropped.
    Sni,
}

impl EgressMode {
    /// Parses the wire value of the option `field` ("dns" or "sni").
    pub fn parse(field: &str, value: &str) -> Result<Self, AgentError> {
        match value {
            "dns" => Ok(EgressMode::Dns),
            "sni" => Ok(EgressMode::Sni),
            other => Err(invalid(format!(
                "{field}: '{other}' is not an egress mode (use 'dns' or 'sni')"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EgressMode::Dns => "dns",
            EgressMode::Sni => "sni",
        }
    }

    pub fn is_dns(&self) -> bool {
        *self == EgressMode::Dns
    }
}

/// How a sandbox is attached to the node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Attach {
    /// A TAP from the warm pool, handed to a VMM with OpenTap.
    #[default]
    Tap,
    /// A veth pair (CNI): the host end plays the TAP's role in the
    /// datapath; the peer is created as `ifname` directly in the network
    /// namespace `netns` (the agent never enters it).
    Veth { ifname: String, netns: NetnsFd },
}

/// The attachment as recorded (no fd: the namespace is the kernel's).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum AttachRecord {
    #[default]
    Tap,
    Veth {
        /// The peer's name inside the container's namespace.
        ifname: String,
        /// The container's namespace (records from before it was kept
        /// have none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        netns: Option<NetnsId>,
        /// The namespace's id in the node's namespace (RTM_GETNSID): it
        /// lives exactly as long as the namespace, so its absence proves
        /// the container's namespace is gone (records from before it was
        /// kept have none, and are never released for that).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nsid: Option<i32>,
    },
}

/// Ids starting with this name CNI attachments (`cni:<container id>:<ifname>`,
/// see `cni::sandbox_id`); only veth networks may use them.
pub const CNI_ID_PREFIX: &str = "cni:";

impl AttachRecord {
    pub fn is_tap(&self) -> bool {
        matches!(self, AttachRecord::Tap)
    }

    /// The kernel's link kind of the host-side device.
    pub fn link_kind(&self) -> &'static str {
        match self {
            AttachRecord::Tap => "tun",
            AttachRecord::Veth { .. } => "veth",
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            AttachRecord::Tap => "tap",
            AttachRecord::Veth { .. } => "veth",
        }
    }
}

impl Attach {
    pub fn record(&self) -> AttachRecord {
        match self {
            Attach::Tap => AttachRecord::Tap,
            Attach::Veth { ifname, netns } => AttachRecord::Veth {
                ifname: ifname.clone(),
                netns: Some(netns.id),
                nsid: None,
            },
        }
    }
}

/// What ReleaseNetworkIf requires of the network before it releases it:
/// every field given must match the record, so a caller acting on an id
/// derived from its own view (a CNI DEL, GC, the cleanup of a failed ADD)
/// never releases something else that happens to carry the id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expect {
    pub network_handle: Option<String>,
    /// "tap" or "veth".
    pub attach: Option<String>,
    pub ifname: Option<String>,
    pub netns: Option<NetnsId>,
    /// Each key must be present in the record's metadata with this value.
    pub metadata: BTreeMap<String, String>,
}

impl Expect {
    /// Ok if `rec` is what the caller expects; else why not, naming the
    /// first field that differs.
    pub fn check(&self, rec: &NetworkRecord) -> Result<(), AgentError> {
        let id = &rec.sandbox_id;
        let differs = |key: &str, have: &dyn std::fmt::Display, want: &dyn std::fmt::Display| {
            Err(AgentError::Conflict(format!(
                "{key}: network '{id}' has {have}, not {want}; nothing was released"
            )))
        };
        if let Some(h) = &self.network_handle
            && *h != rec.network_handle
        {
            return differs(
                "network_handle",
                &format_args!("handle {}", rec.network_handle),
                &format_args!("{h} (it was released and created again)"),
            );
        }
        if let Some(a) = &self.attach
            && a != rec.attach.name()
        {
            return differs(
                "attach",
                &format_args!("a {} attachment", rec.attach.name()),
                &format_args!("'{a}'"),
            );
        }
        let (have_ifname, have_netns) = match &rec.attach {
            AttachRecord::Veth { ifname, netns, .. } => (Some(ifname.as_str()), *netns),
            AttachRecord::Tap => (None, None),
        };
        if let Some(want) = &self.ifname
            && have_ifname != Some(want.as_str())
        {
            return differs(
                "ifname",
                &format_args!("interface '{}'", have_ifname.unwrap_or("(none: a TAP)")),
                &format_args!("'{want}'"),
            );
        }
        if let Some(want) = &self.netns {
            match have_netns {
                Some(have) if have == *want => {}
                Some(have) => {
                    return differs(
                        "netns_fd",
                        &format_args!("its interface in namespace {have}"),
                        &format_args!("in {want}, the namespace passed"),
                    );
                }
                // A record from before namespaces were kept: the other
                // fields decide.
                None if have_ifname.is_some() => {}
                None => {
                    return differs("netns_fd", &"no namespace (a TAP)", &want);
                }
            }
        }
        for (k, want) in &self.metadata {
            match rec.metadata.get(k) {
                Some(have) if have == want => {}
                have => {
                    return differs(
                        &format!("metadata[{k}]"),
                        &format_args!("{have:?}"),
                        &format_args!("'{want}'"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// A network interface name the kernel accepts (`dev_valid_name`): 1-15
/// bytes, not "." or "..", no '/', ':' or whitespace.
pub fn validate_ifname(key: &str, name: &str) -> Result<(), AgentError> {
    let bad = |why: String| Err(invalid(format!("{key}: '{name}' {why}")));
    if name.is_empty() || name.len() > 15 {
        return bad(format!("must be 1-15 bytes, is {}", name.len()));
    }
    if name == "." || name == ".." {
        return bad("is not a valid interface name".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| *c == '/' || *c == ':' || c.is_whitespace() || c.is_control())
    {
        return bad(format!("contains {c:?}, which interface names cannot"));
    }
    // The kernel expands "%d" in a new link's name to the first free
    // number: the interface would get another name than the one asked for
    // (and recorded).
    if name.contains('%') {
        return bad("contains '%', which the kernel would expand (eth%d)".into());
    }
    Ok(())
}

fn invalid(msg: String) -> AgentError {
    AgentError::InvalidArgument(msg)
}

/// One address or CIDR of either family in its canonical form (an address
/// as its /32 or /128; host bits are an error naming the network meant).
fn normalise_cidr(item: &str) -> Result<String, String> {
    if item.contains(':') {
        canonical::<Ipv6Cidr>(item, "IPv6")
    } else {
        canonical::<Ipv4Cidr>(item, "IPv4")
    }
}

fn canonical<C: Cidr>(item: &str, family: &str) -> Result<String, String> {
    let cidr: C = if item.contains('/') {
        item.parse().map_err(|e: CidrError| e.to_string())?
    } else {
        let ip: C::Addr = item
            .parse()
            .map_err(|_| format!("'{item}' is not an {family} address or CIDR"))?;
        C::new(ip, C::BITS).expect("a single address has no host bits")
    };
    Ok(cidr.to_string())
}

/// Normalises a policy list: names checked and lower-cased, addresses and
/// CIDRs in canonical form ([`normalise_cidr`]), duplicates removed.
/// `egress_rules`: each rule checked and normalised
/// ([`crate::rules::EgressRule::validated`], hosts as allow_out's
/// patterns), at most [`crate::rules::MAX_RULES`], one rule per host.
pub(super) fn validate_rules(
    rules: Vec<crate::rules::EgressRule>,
) -> Result<Vec<crate::rules::EgressRule>, AgentError> {
    if rules.len() > crate::rules::MAX_RULES {
        return Err(invalid(format!(
            "egress_rules: {} rules, the limit is {}",
            rules.len(),
            crate::rules::MAX_RULES
        )));
    }
    let mut out: Vec<crate::rules::EgressRule> = Vec::with_capacity(rules.len());
    for (i, r) in rules.into_iter().enumerate() {
        let r = r
            .validated(i, |h| {
                super::domains::DomainPattern::parse(h).map(|p| p.to_string())
            })
            .map_err(invalid)?;
        if let Some(j) = out.iter().position(|o| o.host == r.host) {
            return Err(invalid(format!(
                "egress_rules[{i}].host: '{}' already has a rule (egress_rules[{j}]); one rule \
                 per host",
                r.host
            )));
        }
        out.push(r);
    }
    Ok(out)
}

fn normalise_cidrs(key: &str, list: &[String]) -> Result<Vec<String>, AgentError> {
    if list.len() > MAX_CIDRS {
        return Err(invalid(format!(
            "{key}: {} entries, the limit is {MAX_CIDRS}",
            list.len()
        )));
    }
    let mut out: Vec<String> = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        if super::domains::is_domain_entry(item) {
            let pattern = super::domains::DomainPattern::parse(item).map_err(|why| {
                invalid(format!(
                    "{key}[{i}]: '{item}' is not an IP address, CIDR or domain pattern: {why}"
                ))
            })?;
            let s = pattern.to_string();
            if !out.contains(&s) {
                out.push(s);
            }
            continue;
        }
        let s = normalise_cidr(item).map_err(|e| invalid(format!("{key}[{i}]: {e}")))?;
        if !out.contains(&s) {
            out.push(s);
        }
    }
    Ok(out)
}

/// An IPv6 `host_ip`: "::" (the node's IPv6 address, IPv6 only) or a
/// global address (the agent checks it is the uplink's); the datapath
/// maps IPv6 on the uplink's address alone.
fn host_ip6_usable(a: std::net::Ipv6Addr) -> Result<(), &'static str> {
    if a.to_ipv4_mapped().is_some() {
        Err("an IPv4-mapped address: write the IPv4 address")
    } else if a.is_loopback() {
        Err("mappings through lo are IPv4's: use 127.0.0.1")
    } else if a.is_multicast() || a.is_unicast_link_local() {
        Err("not a unicast address of the node's uplink (use :: or its global IPv6 address)")
    } else {
        Ok(())
    }
}

impl NetworkSpec {
    /// Checks every field; returns the spec in normal form.
    pub fn validated(mut self) -> Result<Self, AgentError> {
        if self.port_mappings.len() > MAX_PORT_MAPPINGS {
            return Err(invalid(format!(
                "port_mappings: {} entries, the limit is {MAX_PORT_MAPPINGS}",
                self.port_mappings.len()
            )));
        }
        for (i, m) in self.port_mappings.iter_mut().enumerate() {
            if m.container_port == 0 {
                return Err(invalid(format!(
                    "port_mappings[{i}]: container_port 0 is not a port (1-65535)"
                )));
            }
            if !m.host_ip.is_empty() {
                let ip: IpAddr = m.host_ip.parse().map_err(|_| {
                    invalid(format!(
                        "port_mappings[{i}]: host_ip '{}' is not an IP address",
                        m.host_ip
                    ))
                })?;
                if let IpAddr::V6(a) = ip {
                    host_ip6_usable(a).map_err(|why| {
                        invalid(format!("port_mappings[{i}]: host_ip {a}: {why}"))
                    })?;
                }
                // One spelling per address: records and comparisons are
                // exact.
                m.host_ip = ip.to_string();
            }
        }
        for (i, m) in self.port_mappings.iter().enumerate() {
            if m.host_port != 0
                && let Some(j) = self.port_mappings[..i]
                    .iter()
                    .position(|o| o.protocol == m.protocol && o.host_port == m.host_port)
            {
                let other = &self.port_mappings[j].host_ip;
                let wildcard4 = |h: &str| h.is_empty() || h == "0.0.0.0";
                let hint = if (m.host_ip == "::" && wildcard4(other))
                    || (other == "::" && wildcard4(&m.host_ip))
                {
                    " (a mapping on 0.0.0.0 is on the node's IPv6 address too: drop the :: one)"
                } else {
                    ""
                };
                return Err(invalid(format!(
                    "port_mappings[{i}]: {} host port {} is also used by port_mappings[{j}]{hint}",
                    m.protocol, m.host_port
                )));
            }
        }
        self.allow_out = normalise_cidrs("allow_out", &self.allow_out)?;
        self.deny_out = normalise_cidrs("deny_out", &self.deny_out)?;
        self.egress_rules = validate_rules(std::mem::take(&mut self.egress_rules))?;
        if self.metadata.len() > MAX_METADATA {
            return Err(invalid(format!(
                "metadata: {} entries, the limit is {MAX_METADATA}",
                self.metadata.len()
            )));
        }
        for (k, v) in &self.metadata {
            if k.is_empty() || k.len() > MAX_METADATA_KEY {
                return Err(invalid(format!(
                    "metadata: key '{k}' must be 1-{MAX_METADATA_KEY} bytes"
                )));
            }
            if v.len() > MAX_METADATA_VALUE {
                return Err(invalid(format!(
                    "metadata[{k}]: value is {} bytes, the limit is {MAX_METADATA_VALUE}",
                    v.len()
                )));
            }
        }
        if let Some(key) = &self.idempotency_key
            && (key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY)
        {
            return Err(invalid(format!(
                "idempotency_key: must be 1-{MAX_IDEMPOTENCY_KEY} bytes"
            )));
        }
        if let Some(mtu) = self.mtu
            && !(MIN_MTU..=MAX_MTU).contains(&mtu)
        {
            return Err(invalid(format!(
                "mtu: {mtu} is out of range {MIN_MTU}-{MAX_MTU}"
            )));
        }
        if let Attach::Veth { ifname, .. } = &self.attach {
            validate_ifname("ifname", ifname)?;
        }
        self.bandwidth.check().map_err(invalid)?;
        self.check_tap_owner()?;
        if self.mapping_wins && matches!(self.attach, Attach::Tap) {
            return Err(invalid(
                "mapping_wins: only a veth attachment (CNI) may have its port mappings win over \
                 host sockets; a TAP network's yield to them (docs/datapath.md)"
                    .into(),
            ));
        }
        if let Some(src) = &self.clone_of {
            validate_sandbox_id(src).map_err(|e| match e {
                AgentError::InvalidArgument(m) => invalid(format!("clone_of: {m}")),
                other => other,
            })?;
            let given = [
                ("port_mappings", !self.port_mappings.is_empty()),
                (
                    "allow_internet_access",
                    self.allow_internet_access.is_some(),
                ),
                ("allow_out", !self.allow_out.is_empty()),
                ("deny_out", !self.deny_out.is_empty()),
                ("mtu", self.mtu.is_some()),
                ("attach", self.attach != Attach::Tap),
                ("egress_mode", !self.egress_mode.is_dns()),
                ("bandwidth", self.bandwidth != Bandwidth::default()),
                ("egress_rules", !self.egress_rules.is_empty()),
            ];
            if let Some((key, _)) = given.iter().find(|(_, set)| *set) {
                return Err(invalid(format!(
                    "clone_of: a clone takes the source's port mappings, policy, MTU and \
                     limits; only metadata, idempotency_key and paused may come with it (got {key})"
                )));
            }
        }
        Ok(self)
    }

    /// `tap_owner_uid`/`tap_owner_gid`: the kernel's "nobody" (-1) is no
    /// owner, a group needs an owner, and only a TAP has one.
    fn check_tap_owner(&self) -> Result<(), AgentError> {
        if self.tap_owner_uid == Some(u32::MAX) {
            return Err(invalid(format!(
                "tap_owner_uid: {} is the kernel's \"no owner\" (anyone could attach); give \
                 the uid the VMM runs as (0 for root)",
                u32::MAX
            )));
        }
        if self.tap_owner_gid == Some(u32::MAX) {
            return Err(invalid(format!(
                "tap_owner_gid: {} is the kernel's \"no group\"; leave tap_owner_gid out instead",
                u32::MAX
            )));
        }
        if self.tap_owner_gid.is_some() && self.tap_owner_uid.is_none() {
            return Err(invalid(
                "tap_owner_gid: needs tap_owner_uid (the uid the VMM runs as); a group alone \
                 would let every member attach"
                    .into(),
            ));
        }
        if self.tap_owner_uid.is_some() && !matches!(self.attach, Attach::Tap) {
            return Err(invalid(
                "tap_owner_uid: a veth attachment (CNI) has no TAP to hand over by name".into(),
            ));
        }
        Ok(())
    }

    /// The TAP's owner when it is handed over by name (after
    /// [`NetworkSpec::validated`]).
    pub fn tap_owner(&self) -> Option<TapOwner> {
        self.tap_owner_uid.map(|uid| TapOwner {
            uid,
            gid: self.tap_owner_gid,
        })
    }

    /// What `rec` was ensured with, as a spec: converging a network with it
    /// changes nothing. `metadata` and `idempotency_key` are the caller's;
    /// no `clone_of` (the spec is a whole one).
    pub fn of_record(rec: &NetworkRecord, caller: &NetworkSpec) -> NetworkSpec {
        NetworkSpec {
            port_mappings: rec.port_mappings.clone(),
            allow_internet_access: Some(rec.allow_internet_access),
            allow_out: rec.allow_out.clone(),
            deny_out: rec.deny_out.clone(),
            metadata: caller.metadata.clone(),
            idempotency_key: caller.idempotency_key.clone(),
            mtu: Some(rec.mtu),
            attach: Attach::Tap,
            egress_mode: rec.egress_mode,
            bandwidth: rec.bandwidth,
            clone_of: None,
            paused: caller.paused,
            // How the TAP is handed over is the caller's: a clone restored
            // by name gets its own owner.
            tap_owner_uid: caller.tap_owner_uid,
            tap_owner_gid: caller.tap_owner_gid,
            // A TAP's spec (clones are TAP networks): mappings yield.
            mapping_wins: false,
            sandbox_ip: caller.sandbox_ip,
            sandbox_ipv6: caller.sandbox_ipv6,
            egress_rules: rec.egress_rules.clone(),
        }
    }

    /// The spec of a new clone of `source`: the source's, with every
    /// mapping's host port left to the allocator (the source holds its
    /// own), and the caller's metadata and idempotency key.
    pub fn clone_from(source: &NetworkRecord, caller: &NetworkSpec) -> NetworkSpec {
        let mut spec = Self::of_record(source, caller);
        for m in &mut spec.port_mappings {
            m.host_port = 0;
        }
        spec
    }

    /// The id rule that ties ids to attachments: `cni:` ids name CNI
    /// (veth) attachments and nothing else, so a CNI verb can never reach
    /// a VMM's TAP network by its id.
    pub fn check_id(&self, id: &str) -> Result<(), AgentError> {
        if id.starts_with(CNI_ID_PREFIX) && matches!(self.attach, Attach::Tap) {
            return Err(invalid(format!(
                "sandbox_id: ids starting with '{CNI_ID_PREFIX}' name CNI attachments \
                 (attach 'veth'); a TAP network needs another id"
            )));
        }
        Ok(())
    }
}

/// The durable record of one sandbox network (JSON in the store). Fields
/// added later get `#[serde(default)]` so older records still load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRecord {
    pub version: u32,
    pub sandbox_id: String,
    pub network_handle: String,
    pub sandbox_ip: IpAddr,
    pub tap_name: String,
    pub mtu: u32,
    pub port_mappings: Vec<PortMapping>,
    pub allow_internet_access: bool,
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    pub created_unix: u64,
    /// TAP (the default, and what older records mean) or veth.
    #[serde(default, skip_serializing_if = "AttachRecord::is_tap")]
    pub attach: AttachRecord,
    /// DNS (the default, and what older records mean) or SNI.
    #[serde(default, skip_serializing_if = "EgressMode::is_dns")]
    pub egress_mode: EgressMode,
    /// The limits in force (the caller's, or the node's defaults when it
    /// gave none); none in records from before limits.
    #[serde(default, skip_serializing_if = "Bandwidth::is_unlimited")]
    pub bandwidth: Bandwidth,
    /// The sandbox whose spec this network was created from (`clone_of`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloned_from: Option<String>,
    /// Paused (EnsureNetwork `paused`): packets for the sandbox are
    /// dropped and the first of each pause reported.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Its port mappings win over host sockets that bind their ports
    /// later (EnsureNetwork `mapping_wins`, a CNI attachment's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mapping_wins: bool,
    /// Set when the TAP is handed over by name (`tap_owner_uid`): the
    /// agent holds no fd of it and never opens it while the network lives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap_owner: Option<TapOwner>,
    /// Egress rules (EnsureNetwork `egress_rules`); their header values are
    /// secrets: the store's files are the owner's only, and no view shows
    /// them ([`crate::rules::EgressRule::shown`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_rules: Vec<crate::rules::EgressRule>,
}

impl NetworkRecord {
    /// The TAP is handed over by name: the agent holds no fd of it.
    pub fn by_name(&self) -> bool {
        self.tap_owner.is_some()
    }

    /// Whether the sandbox's IPv6 may reach the world
    /// ([`crate::types::ipv6_open`]).
    pub fn ipv6_open(&self) -> bool {
        crate::types::ipv6_open(self.allow_internet_access, &self.allow_out, &self.deny_out)
    }

    /// Whether the egress rules' hosts join the allow names (learned by
    /// the resolver, as an allow_out name): when the sandbox has allow
    /// names already, or does not reach the world at large (where its
    /// rules' hosts would be closed). A sandbox open to the world with no
    /// allow names reaches them anyway; adding names would close the rest.
    pub fn rule_names(&self) -> bool {
        if self.egress_rules.is_empty() || !self.allow_internet_access {
            return false;
        }
        let cidrs = super::egress::CidrRules::from_lists(&self.allow_out, &self.deny_out);
        self.allow_out
            .iter()
            .any(|e| crate::types::is_domain_entry(e))
            || !super::egress::world_open(self.allow_internet_access, &cidrs)
    }

    /// `allow_out` with the rules' hosts when they join the allow names
    /// ([`NetworkRecord::rule_names`]).
    pub fn allow_names(&self) -> std::borrow::Cow<'_, [String]> {
        if !self.rule_names() {
            return std::borrow::Cow::Borrowed(&self.allow_out);
        }
        let mut all = self.allow_out.clone();
        for r in &self.egress_rules {
            if !all.contains(&r.host) {
                all.push(r.host.clone());
            }
        }
        std::borrow::Cow::Owned(all)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record always serialises")
    }

    /// Parses and checks a stored record; the error says why it is unusable.
    pub fn from_bytes(key: &str, bytes: &[u8]) -> Result<Self, String> {
        let rec: NetworkRecord =
            serde_json::from_slice(bytes).map_err(|e| format!("not a valid record: {e}"))?;
        if rec.version != RECORD_VERSION {
            return Err(format!("unsupported record version {}", rec.version));
        }
        if rec.sandbox_id != key {
            return Err(format!(
                "record for '{}' stored under key '{key}'",
                rec.sandbox_id
            ));
        }
        validate_sandbox_id(&rec.sandbox_id).map_err(|e| e.to_string())?;
        Ok(rec)
    }
}

/// TAP name of a sandbox: prefix + the address in hex (8 chars for IPv4,
/// so a prefix of at most 7 keeps it within IFNAMSIZ for any pool CIDR).
pub fn tap_name_for(prefix: &str, ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{prefix}{:08x}", u32::from(v4)),
        // Not used yet (IPv4 pools only); keeps the name within 15 bytes.
        IpAddr::V6(v6) => format!("{prefix}{:08x}", u128::from(v6) as u32),
    }
}

/// Idle pool TAPs: prefix + 'w' + 7 hex digits ('w' is never a hex digit,
/// so pool and sandbox names cannot collide).
pub fn pool_tap_name(prefix: &str, n: u32) -> String {
    format!("{prefix}w{:07x}", n & 0x0fff_ffff)
}

/// TAPs handed over by name: prefix + 'n' + 7 hex digits of a counter
/// kept in the state directory, so a name is never used twice on a node
/// ('n' is not a hex digit: no collision with the other kinds).
pub fn by_name_tap_name(prefix: &str, n: u32) -> String {
    format!("{prefix}n{:07x}", n & 0x0fff_ffff)
}

/// A released veth's host end while it waits for deletion: prefix + 'x' +
/// its ifindex (unique while it exists; 'x' is not a hex digit, so it never
/// looks like a sandbox or pool name).
pub fn retired_veth_name(prefix: &str, ifindex: u32) -> String {
    format!("{prefix}x{:07x}", ifindex & 0x0fff_ffff)
}

/// What a TAP name of ours says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TapNameKind {
    Sandbox(Ipv4Addr),
    Pool(u32),
    ByName(u32),
    Foreign,
}

pub fn classify_tap_name(prefix: &str, name: &str) -> TapNameKind {
    let Some(rest) = name.strip_prefix(prefix) else {
        return TapNameKind::Foreign;
    };
    let counter = |kind: char| {
        rest.strip_prefix(kind)
            .filter(|n| n.len() == 7)
            .and_then(|n| u32::from_str_radix(n, 16).ok())
    };
    if let Some(n) = counter('w') {
        return TapNameKind::Pool(n);
    }
    if let Some(n) = counter('n') {
        return TapNameKind::ByName(n);
    }
    if rest.len() == 8
        && rest
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        && let Ok(v) = u32::from_str_radix(rest, 16)
    {
        return TapNameKind::Sandbox(Ipv4Addr::from(v));
    }
    TapNameKind::Foreign
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Protocol;

    #[test]
    fn sandbox_ids() {
        for ok in ["a", "sbx-1", "A.b:c_d-9", &"x".repeat(128), "0"] {
            validate_sandbox_id(ok).unwrap();
        }
        for (bad, why) in [
            ("", "empty"),
            (&"x".repeat(129) as &str, "limit is 128"),
            (".hidden", "start"),
            ("-flag", "start"),
            ("a/b", "'/'"),
            ("a b", "' '"),
            ("sbx\u{e9}", "not allowed"),
            ("a\0b", "not allowed"),
        ] {
            let e = validate_sandbox_id(bad).unwrap_err().to_string();
            assert!(e.starts_with("sandbox_id: "), "{e}");
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    fn pm(proto: Protocol, c: u16, h: u16, ip: &str) -> PortMapping {
        PortMapping {
            protocol: proto,
            container_port: c,
            host_port: h,
            host_ip: ip.into(),
        }
    }

    fn err(spec: NetworkSpec) -> String {
        spec.validated().unwrap_err().to_string()
    }

    #[test]
    fn spec_errors_name_the_field() {
        let s = |m: Vec<PortMapping>| NetworkSpec {
            port_mappings: m,
            ..Default::default()
        };
        assert!(
            err(s(vec![pm(Protocol::Tcp, 0, 0, "")])).contains("port_mappings[0]: container_port")
        );
        assert!(err(s(vec![pm(Protocol::Tcp, 80, 0, "nope")])).contains("host_ip 'nope'"));
        for (bad, why) in [
            ("::1", "use 127.0.0.1"),
            ("::ffff:10.0.0.1", "write the IPv4 address"),
            ("fe80::1", "not a unicast address of the node's uplink"),
            ("ff02::1", "not a unicast address of the node's uplink"),
        ] {
            let e = err(s(vec![pm(Protocol::Tcp, 80, 0, bad)]));
            assert!(
                e.contains(&format!("port_mappings[0]: host_ip {bad}: ")),
                "{e}"
            );
            assert!(e.contains(why), "{bad}: {e}");
        }
        // IPv6 host addresses in one spelling.
        let v6 = s(vec![
            pm(Protocol::Tcp, 80, 0, "0:0::0"),
            pm(Protocol::Tcp, 81, 0, "2001:DB8:0::1"),
        ])
        .validated()
        .unwrap();
        assert_eq!(v6.port_mappings[0].host_ip, "::");
        assert_eq!(v6.port_mappings[1].host_ip, "2001:db8::1");
        let both = err(s(vec![
            pm(Protocol::Tcp, 80, 8080, "0.0.0.0"),
            pm(Protocol::Tcp, 80, 8080, "::"),
        ]));
        assert!(both.contains("drop the :: one"), "{both}");
        let dup = err(s(vec![
            pm(Protocol::Tcp, 80, 8080, ""),
            pm(Protocol::Tcp, 81, 8080, ""),
        ]));
        assert!(
            dup.contains("port_mappings[1]") && dup.contains("port_mappings[0]"),
            "{dup}"
        );
        // Same host port on different protocols is fine.
        s(vec![
            pm(Protocol::Tcp, 80, 8080, ""),
            pm(Protocol::Udp, 80, 8080, ""),
        ])
        .validated()
        .unwrap();
        assert!(err(s(vec![pm(Protocol::Tcp, 1, 0, ""); 65])).contains("limit is 64"));
        let cidr = |deny: &[&str]| NetworkSpec {
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        assert!(err(cidr(&["10.0.0.1/8"])).contains("deny_out[0]"));
        assert!(err(cidr(&["10.0.0.1/8"])).contains("10.0.0.0/8"));
        assert!(err(cidr(&["1.1.1.1", "1.2.3.400"])).contains("deny_out[1]"));
        let e = err(cidr(&["1.1.1.1", "a..example.com"]));
        assert!(
            e.contains("deny_out[1]: 'a..example.com' is not an IP address, CIDR or domain pattern: an empty label"),
            "{e}"
        );
        let e = err(cidr(&["*.com"]));
        assert!(e.contains("deny_out[0]") && e.contains("top-level"), "{e}");
        let norm = cidr(&[
            "1.1.1.1",
            "10.0.0.0/8",
            "1.1.1.1/32",
            "*.Example.COM.",
            "*.example.com",
        ])
        .validated()
        .unwrap();
        assert_eq!(
            norm.deny_out,
            vec!["1.1.1.1/32", "10.0.0.0/8", "*.example.com"]
        );
        // IPv6: addresses and CIDRs, in canonical form.
        let norm = cidr(&["2001:DB8::1", "2001:db8:0::/32", "::/0", "2001:db8::1/128"])
            .validated()
            .unwrap();
        assert_eq!(
            norm.deny_out,
            vec!["2001:db8::1/128", "2001:db8::/32", "::/0"]
        );
        let e = err(cidr(&["2001:db8::1/32"]));
        assert!(
            e.contains("deny_out[0]") && e.contains("did you mean 2001:db8::/32"),
            "{e}"
        );
        let e = err(cidr(&["10.0.0.0/8", "2001:db8::/200"]));
        assert!(e.contains("deny_out[1]") && e.contains("0-128"), "{e}");
        let e = err(cidr(&["fe80::1%eth0"]));
        assert!(e.contains("is not an IPv6 address or CIDR"), "{e}");
        let mtu = NetworkSpec {
            mtu: Some(50),
            ..Default::default()
        };
        assert!(err(mtu).contains("mtu: 50"));
        let md = NetworkSpec {
            metadata: [("".to_string(), "v".to_string())].into(),
            ..Default::default()
        };
        assert!(err(md).contains("metadata"));
        let key = NetworkSpec {
            idempotency_key: Some(String::new()),
            ..Default::default()
        };
        assert!(err(key).contains("idempotency_key"));
        let clone = |spec: NetworkSpec| NetworkSpec {
            clone_of: Some("golden".into()),
            ..spec
        };
        clone(NetworkSpec::default()).validated().unwrap();
        clone(NetworkSpec {
            metadata: [("k".to_string(), "v".to_string())].into(),
            idempotency_key: Some("req".into()),
            ..Default::default()
        })
        .validated()
        .unwrap();
        let e = err(clone(cidr(&["1.1.1.1"])));
        assert!(
            e.contains("clone_of") && e.contains("(got deny_out)"),
            "{e}"
        );
        let e = err(clone(NetworkSpec {
            mtu: Some(1400),
            ..Default::default()
        }));
        assert!(e.contains("(got mtu)"), "{e}");
        let e = err(NetworkSpec {
            clone_of: Some("-x".into()),
            ..Default::default()
        });
        assert!(e.contains("clone_of: sandbox_id: must not start"), "{e}");
    }

    #[test]
    fn tap_owner_options() {
        let owner = |uid: Option<u32>, gid: Option<u32>| NetworkSpec {
            tap_owner_uid: uid,
            tap_owner_gid: gid,
            ..Default::default()
        };
        // uid 0 is a VMM run as root; gid 0 is a group like any other.
        for (uid, gid) in [(Some(0), None), (Some(1000), Some(0)), (None, None)] {
            let s = owner(uid, gid).validated().unwrap();
            assert_eq!(s.tap_owner().map(|o| (o.uid, o.gid)), uid.map(|u| (u, gid)));
        }
        for (uid, gid, want) in [
            (
                Some(u32::MAX),
                None,
                "tap_owner_uid: 4294967295 is the kernel's",
            ),
            (Some(1), Some(u32::MAX), "tap_owner_gid: 4294967295"),
            (None, Some(1000), "tap_owner_gid: needs tap_owner_uid"),
        ] {
            let e = err(owner(uid, gid));
            assert!(e.contains(want), "{uid:?} {gid:?}: {e}");
        }
        // A clone may be handed over by name.
        let clone = NetworkSpec {
            clone_of: Some("golden".into()),
            ..owner(Some(1000), None)
        };
        clone.validated().unwrap();
    }

    #[test]
    fn ipv6_is_open_unless_strict_or_every_ipv6_address_is_denied() {
        let rec = |allow: &[&str], deny: &[&str]| -> NetworkRecord {
            serde_json::from_value(serde_json::json!({
                "version": RECORD_VERSION, "sandbox_id": "s", "network_handle": "h",
                "sandbox_ip": "192.168.0.2", "tap_name": "t", "mtu": 1500,
                "port_mappings": [], "allow_internet_access": true,
                "allow_out": allow, "deny_out": deny, "metadata": {},
                "created_unix": 1,
            }))
            .unwrap()
        };
        assert!(rec(&[], &[]).ipv6_open());
        // Rules of IPv4 CIDRs only were written for IPv4: IPv4-only.
        assert!(!rec(&["10.0.0.0/8"], &["1.1.1.1/32"]).ipv6_open());
        assert!(!rec(&[], &["203.0.113.5/32"]).ipv6_open());
        assert!(rec(&[], &["203.0.113.5/32", "2001:db8::/32"]).ipv6_open());
        assert!(rec(&[], &["2001:db8::/32"]).ipv6_open());
        assert!(rec(&[], &["*.evil.test"]).ipv6_open());
        assert!(rec(&["2001:db8::1/128"], &["0.0.0.0/0"]).ipv6_open());
        // An IPv4 allow-list, or ::/0 denied: no IPv6 left open.
        assert!(!rec(&["198.51.100.0/24"], &["0.0.0.0/0"]).ipv6_open());
        assert!(!rec(&[], &["::/0"]).ipv6_open());
        // Allowed names open IPv6 (their AAAA answers are learned).
        assert!(rec(&["*.example.com"], &["0.0.0.0/0"]).ipv6_open());
        assert!(rec(&[], &["*.example.com"]).ipv6_open());
        // Strict mode's proxy takes IPv6 too.
        let mut strict = rec(&["*.example.com"], &["0.0.0.0/0"]);
        strict.egress_mode = EgressMode::Sni;
        assert!(strict.ipv6_open());
        let mut off = rec(&[], &[]);
        off.allow_internet_access = false;
        assert!(!off.ipv6_open());
    }

    #[test]
    fn record_roundtrip_and_rejects() {
        let rec = NetworkRecord {
            version: RECORD_VERSION,
            sandbox_id: "sbx-1".into(),
            network_handle: "00ff".into(),
            sandbox_ip: "192.168.0.2".parse().unwrap(),
            tap_name: "ctapc0a80002".into(),
            mtu: 1300,
            port_mappings: vec![pm(Protocol::Udp, 53, 20001, "")],
            allow_internet_access: false,
            allow_out: vec!["10.0.0.0/8".into()],
            deny_out: vec![],
            metadata: [("k".to_string(), "v".to_string())].into(),
            idempotency_key: Some("req-1".into()),
            created_unix: 1,
            attach: Default::default(),
            egress_mode: EgressMode::Sni,
            bandwidth: Bandwidth {
                egress_bps: 40_000_000,
                ingress_burst: 0,
                ingress_bps: 1_000_000_000,
                egress_burst: 1 << 20,
            },
            cloned_from: Some("golden".into()),
            paused: true,
            mapping_wins: true,
            tap_owner: Some(TapOwner {
                uid: 1000,
                gid: Some(0),
            }),
            egress_rules: vec![crate::rules::EgressRule {
                host: "api.example.com".into(),
                set_headers: [(
                    "authorization".to_string(),
                    crate::rules::Secret::new("Bearer t0ken".into()),
                )]
                .into(),
                methods: vec!["GET".into()],
                paths: vec!["/v1".into()],
                plain_http: false,
            }],
        };
        let bytes = rec.to_bytes();
        assert_eq!(NetworkRecord::from_bytes("sbx-1", &bytes).unwrap(), rec);
        // The store keeps the secret (its files are the owner's only); a
        // record formatted for a log never shows it.
        assert!(String::from_utf8_lossy(&bytes).contains("Bearer t0ken"));
        assert!(!format!("{rec:?}").contains("t0ken"));
        // A record from before clones and pauses loads with neither.
        let mut old: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        old.as_object_mut().unwrap().remove("cloned_from");
        old.as_object_mut().unwrap().remove("paused");
        old.as_object_mut().unwrap().remove("tap_owner");
        let old = NetworkRecord::from_bytes("sbx-1", &serde_json::to_vec(&old).unwrap()).unwrap();
        assert_eq!(
            (old.cloned_from, old.paused, old.tap_owner),
            (None, false, None)
        );

        // A clone's spec is the source's with fresh host ports and the
        // caller's metadata; converging with the record's own changes
        // nothing.
        let caller = NetworkSpec {
            metadata: [("clone".to_string(), "1".to_string())].into(),
            clone_of: Some("sbx-1".into()),
            ..Default::default()
        };
        let c = NetworkSpec::clone_from(&rec, &caller).validated().unwrap();
        assert_eq!(c.port_mappings, vec![pm(Protocol::Udp, 53, 0, "")]);
        assert_eq!((c.allow_internet_access, c.mtu), (Some(false), Some(1300)));
        assert_eq!(
            (&c.allow_out, c.egress_mode),
            (&rec.allow_out, EgressMode::Sni)
        );
        assert_eq!(c.egress_rules, rec.egress_rules);
        assert_eq!(
            (c.bandwidth, &c.metadata),
            (rec.bandwidth, &caller.metadata)
        );
        let same = NetworkSpec::of_record(&rec, &caller);
        assert_eq!(same.port_mappings, rec.port_mappings);
        assert!(
            NetworkRecord::from_bytes("other", &bytes)
                .unwrap_err()
                .contains("stored under")
        );
        assert!(
            NetworkRecord::from_bytes("sbx-1", b"{garbage")
                .unwrap_err()
                .contains("not a valid record")
        );
        let mut v2 = rec.clone();
        v2.version = 2;
        assert!(
            NetworkRecord::from_bytes("sbx-1", &v2.to_bytes())
                .unwrap_err()
                .contains("version")
        );
    }

    #[test]
    fn tap_names_fit_and_classify() {
        let ip: IpAddr = "192.168.0.2".parse().unwrap();
        let name = tap_name_for("ctapxyz", ip);
        assert_eq!(name, "ctapxyzc0a80002");
        assert!(name.len() < libc::IFNAMSIZ);
        assert_eq!(
            classify_tap_name("ctap", "ctapc0a80002"),
            TapNameKind::Sandbox("192.168.0.2".parse().unwrap())
        );
        assert_eq!(
            classify_tap_name("ctap", &pool_tap_name("ctap", 42)),
            TapNameKind::Pool(42)
        );
        assert_eq!(pool_tap_name("ctapxyz", u32::MAX).len(), 15);
        assert_eq!(
            classify_tap_name("ctap", &by_name_tap_name("ctap", 0x1234)),
            TapNameKind::ByName(0x1234)
        );
        assert_eq!(by_name_tap_name("ctapxyz", u32::MAX).len(), 15);
        assert_eq!(classify_tap_name("ctap", "eth0"), TapNameKind::Foreign);
        assert_eq!(
            classify_tap_name("ctap", "ctapC0A80002"),
            TapNameKind::Foreign
        );
        assert_eq!(classify_tap_name("ctap", "ctap0"), TapNameKind::Foreign);
    }
}
