//! The D-Bus wire edge: `org.cube.NetworkAgent` on `/org/cube/NetworkAgent`.
//! It only translates between `a{sv}` dictionaries and the agent core;
//! [`Error`]'s `From<AgentError>` and `From<AuthError>` are the one place
//! where core and authorization errors become D-Bus errors. Every method
//! asks [`Authority`] first (SPEC §5); properties stay readable by anyone.

pub mod bounded;
mod gate;
mod mirror;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tracing::{debug, info};
use zbus::message::{Flags, Header};
use zbus::names::ErrorName;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};
use zbus::{Connection, DBusError, fdo, interface};

use crate::agent::spec::{
    Attach, AttachRecord, Bandwidth, EgressMode, Expect, NetworkSpec, PortMapping,
};
use crate::agent::{Agent, AgentError, NetworkInfo, ReconcileReport};
use crate::auth::{Action, AuthError, Authority};
use crate::config::BusChoice;

pub const BUS_NAME: &str = "org.cube.NetworkAgent";
pub const MANAGER_PATH: &str = "/org/cube/NetworkAgent";
pub const NETWORK_PATH_PREFIX: &str = "/org/cube/NetworkAgent/network";

/// Errors on the wire: `org.cube.NetworkAgent.Error.*`, plus the two
/// standard authorization errors `org.freedesktop.DBus.Error.AccessDenied`
/// and `org.freedesktop.DBus.Error.InteractiveAuthorizationRequired`.
/// (`#[derive(zbus::DBusError)]` puts one prefix on every variant, so the
/// names are spelled out here.)
#[derive(Debug)]
pub enum Error {
    ZBus(zbus::Error),
    InvalidArgument(String),
    NotFound(String),
    NodeFull(String),
    PortInUse(String),
    TapBusy(String),
    Conflict(String),
    Failed(String),
    AccessDenied(String),
    InteractiveAuthorizationRequired(String),
}

impl DBusError for Error {
    fn name(&self) -> ErrorName<'_> {
        ErrorName::from_static_str_unchecked(match self {
            Error::ZBus(_) => "org.freedesktop.zbus.Error",
            Error::InvalidArgument(_) => "org.cube.NetworkAgent.Error.InvalidArgument",
            Error::NotFound(_) => "org.cube.NetworkAgent.Error.NotFound",
            Error::NodeFull(_) => "org.cube.NetworkAgent.Error.NodeFull",
            Error::PortInUse(_) => "org.cube.NetworkAgent.Error.PortInUse",
            Error::TapBusy(_) => "org.cube.NetworkAgent.Error.TapBusy",
            Error::Conflict(_) => "org.cube.NetworkAgent.Error.Conflict",
            Error::Failed(_) => "org.cube.NetworkAgent.Error.Failed",
            Error::AccessDenied(_) => "org.freedesktop.DBus.Error.AccessDenied",
            Error::InteractiveAuthorizationRequired(_) => {
                "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"
            }
        })
    }

    fn description(&self) -> Option<&str> {
        match self {
            Error::ZBus(_) => None,
            Error::InvalidArgument(m)
            | Error::NotFound(m)
            | Error::NodeFull(m)
            | Error::PortInUse(m)
            | Error::TapBusy(m)
            | Error::Conflict(m)
            | Error::Failed(m)
            | Error::AccessDenied(m)
            | Error::InteractiveAuthorizationRequired(m) => Some(m),
        }
    }

    fn create_reply(&self, call: &Header<'_>) -> zbus::Result<zbus::message::Message> {
        let msg = match self {
            Error::ZBus(e) => e.to_string(),
            _ => self.description().unwrap_or_default().to_owned(),
        };
        zbus::message::Message::error(call, self.name())?.build(&(msg,))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::ZBus(e) => write!(f, "{}: {e}", self.name()),
            _ => write!(f, "{}: {}", self.name(), self.description().unwrap_or("")),
        }
    }
}

impl std::error::Error for Error {}

impl From<zbus::Error> for Error {
    fn from(e: zbus::Error) -> Self {
        Error::ZBus(e)
    }
}

/// Every authorization failure is a denial; only a polkit challenge maps
/// to `InteractiveAuthorizationRequired`.
impl From<AuthError> for Error {
    fn from(e: AuthError) -> Self {
        match e {
            e @ AuthError::InteractionRequired { .. } => {
                Error::InteractiveAuthorizationRequired(e.to_string())
            }
            e @ (AuthError::Denied { .. }
            | AuthError::PolkitUnreachable { .. }
            | AuthError::PolkitFailed { .. }
            | AuthError::UnknownCaller { .. }) => Error::AccessDenied(e.to_string()),
        }
    }
}

impl From<AgentError> for Error {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::InvalidArgument(m) => Error::InvalidArgument(m),
            e @ AgentError::NotFound(_) => Error::NotFound(e.to_string()),
            e @ AgentError::NodeFull { .. } => Error::NodeFull(e.to_string()),
            AgentError::PortInUse(m) => Error::PortInUse(m),
            e @ AgentError::TapBusy { .. } => Error::TapBusy(e.to_string()),
            AgentError::Conflict(m) => Error::Conflict(m),
            AgentError::Failed(m) => Error::Failed(m),
        }
    }
}

/// Object path of a sandbox's network object, exactly as libsystemd's
/// `sd_bus_path_encode(NETWORK_PATH_PREFIX, id)`: every byte outside
/// `[A-Za-z0-9]` becomes `_xx` (lower-case hex), a leading digit too, and
/// "" becomes `_`.
pub fn network_path(sandbox_id: &str) -> OwnedObjectPath {
    let mut p = String::with_capacity(NETWORK_PATH_PREFIX.len() + 2 + sandbox_id.len() * 3);
    p.push_str(NETWORK_PATH_PREFIX);
    p.push('/');
    if sandbox_id.is_empty() {
        p.push('_');
    }
    for (i, b) in sandbox_id.bytes().enumerate() {
        if b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()) {
            p.push(b as char);
        } else {
            p.push_str(&format!("_{b:02x}"));
        }
    }
    OwnedObjectPath::try_from(p).expect("escaped path is valid")
}

pub const OPTION_KEYS: &[&str] = &[
    "port_mappings",
    "allow_internet_access",
    "allow_out",
    "deny_out",
    "metadata",
    "idempotency_key",
    "mtu",
    "attach",
    "netns_fd",
    "ifname",
    "egress_mode",
    "egress_bps",
    "ingress_bps",
    "egress_burst",
    "ingress_burst",
    "clone_of",
    "paused",
    "tap_owner_uid",
    "tap_owner_gid",
    "mapping_wins",
    "sandbox_ip",
    "sandbox_ipv6",
    "egress_rules",
];

fn bad(msg: String) -> AgentError {
    AgentError::InvalidArgument(msg)
}

/// Converts one option after checking its D-Bus type.
fn typed<T>(key: &str, v: &OwnedValue, sig: &str) -> Result<T, AgentError>
where
    T: TryFrom<Value<'static>>,
{
    let got = v.value_signature().to_string();
    if got != sig {
        return Err(bad(format!(
            "option {key}: expected type '{sig}', got '{got}'"
        )));
    }
    let owned = v
        .try_clone()
        .map_err(|e| bad(format!("option {key}: {e}")))?;
    T::try_from(Value::from(owned))
        .map_err(|_| bad(format!("option {key}: malformed '{sig}' value")))
}

/// `egress_rules aa{sv}`: each rule's fields by name (host s, set_headers
/// a{ss}, methods as, paths as, plain_http b); the core validates them.
/// No error quotes a header value (a secret).
fn rules_option(key: &str, v: &OwnedValue) -> Result<Vec<crate::rules::EgressRule>, AgentError> {
    let raw: Vec<HashMap<String, OwnedValue>> = typed(key, v, "aa{sv}")?;
    rules_from(key, &raw)
}

/// Rules from their dictionaries (`key` names them in errors).
fn rules_from(
    key: &str,
    raw: &[HashMap<String, OwnedValue>],
) -> Result<Vec<crate::rules::EgressRule>, AgentError> {
    use crate::rules::{EgressRule, MAX_RULES, Secret};
    if raw.len() > MAX_RULES {
        return Err(bad(format!(
            "{key}: {} rules, the limit is {MAX_RULES}",
            raw.len()
        )));
    }
    let mut rules = Vec::with_capacity(raw.len());
    for (i, fields) in raw.iter().enumerate() {
        let mut r = EgressRule::default();
        let mut names: Vec<&String> = fields.keys().collect();
        names.sort();
        for name in names {
            let v = &fields[name];
            let field = format!("{key}[{i}].{name}");
            match name.as_str() {
                "host" => r.host = typed(&field, v, "s")?,
                "set_headers" => {
                    let m: HashMap<String, String> = typed(&field, v, "a{ss}")?;
                    r.set_headers = m.into_iter().map(|(k, v)| (k, Secret::new(v))).collect();
                    if r.set_headers.len() != fields_len(v) {
                        return Err(bad(format!("{field}: a header is given twice")));
                    }
                }
                "methods" => r.methods = typed(&field, v, "as")?,
                "paths" => r.paths = typed(&field, v, "as")?,
                "plain_http" => r.plain_http = typed(&field, v, "b")?,
                other => {
                    return Err(bad(format!(
                        "{key}[{i}]: unknown field '{other}' (known: host, set_headers, \
                         methods, paths, plain_http)"
                    )));
                }
            }
        }
        rules.push(r);
    }
    Ok(rules)
}

/// How many entries a dictionary value holds.
fn fields_len(v: &OwnedValue) -> usize {
    match &**v {
        Value::Dict(d) => d.iter().count(),
        _ => 0,
    }
}

/// `a{sv}` options → a spec. Unknown keys and wrong types name the key.
pub fn parse_options(options: &HashMap<String, OwnedValue>) -> Result<NetworkSpec, AgentError> {
    let mut spec = NetworkSpec::default();
    let mut attach: Option<String> = None;
    let mut netns: Option<std::os::fd::OwnedFd> = None;
    let mut ifname: Option<String> = None;
    let mut keys: Vec<&String> = options.keys().collect();
    keys.sort();
    for key in keys {
        let v = &options[key];
        match key.as_str() {
            "port_mappings" => {
                let raw: Vec<(String, u16, u16, String)> = typed(key, v, "a(sqqs)")?;
                for (i, (proto, container_port, host_port, host_ip)) in raw.into_iter().enumerate()
                {
                    let protocol = proto.parse().map_err(|()| {
                        bad(format!(
                            "port_mappings[{i}]: protocol '{proto}' is not 'tcp' or 'udp'"
                        ))
                    })?;
                    spec.port_mappings.push(PortMapping {
                        protocol,
                        container_port,
                        host_port,
                        host_ip,
                    });
                }
            }
            "allow_internet_access" => spec.allow_internet_access = Some(typed(key, v, "b")?),
            "allow_out" => spec.allow_out = typed(key, v, "as")?,
            "deny_out" => spec.deny_out = typed(key, v, "as")?,
            "metadata" => {
                let m: HashMap<String, String> = typed(key, v, "a{ss}")?;
                spec.metadata = m.into_iter().collect();
            }
            "idempotency_key" => spec.idempotency_key = Some(typed(key, v, "s")?),
            "mtu" => spec.mtu = Some(typed(key, v, "u")?),
            "attach" => attach = Some(typed(key, v, "s")?),
            "ifname" => ifname = Some(typed(key, v, "s")?),
            "netns_fd" => netns = Some(fd_option(key, v)?),
            "egress_mode" => {
                spec.egress_mode = EgressMode::parse(key, &typed::<String>(key, v, "s")?)?
            }
            "egress_bps" => spec.bandwidth.egress_bps = typed(key, v, "t")?,
            "ingress_bps" => spec.bandwidth.ingress_bps = typed(key, v, "t")?,
            "egress_burst" => spec.bandwidth.egress_burst = typed(key, v, "t")?,
            "ingress_burst" => spec.bandwidth.ingress_burst = typed(key, v, "t")?,
            "clone_of" => spec.clone_of = Some(typed(key, v, "s")?),
            "paused" => spec.paused = typed(key, v, "b")?,
            "tap_owner_uid" => spec.tap_owner_uid = Some(typed(key, v, "u")?),
            "tap_owner_gid" => spec.tap_owner_gid = Some(typed(key, v, "u")?),
            "mapping_wins" => spec.mapping_wins = typed(key, v, "b")?,
            "sandbox_ip" => {
                spec.sandbox_ip = Some(crate::agent::cni::parse_sandbox_ip(&typed::<String>(
                    key, v, "s",
                )?)?)
            }
            "sandbox_ipv6" => {
                spec.sandbox_ipv6 = Some(crate::agent::cni::parse_sandbox_ipv6(&typed::<String>(
                    key, v, "s",
                )?)?)
            }
            "egress_rules" => spec.egress_rules = rules_option(key, v)?,
            other => {
                return Err(bad(format!(
                    "unknown option '{other}' (known: {})",
                    OPTION_KEYS.join(", ")
                )));
            }
        }
    }
    spec.attach = match (attach.as_deref().unwrap_or("tap"), netns, ifname) {
        ("tap", None, None) => Attach::Tap,
        ("tap", _, _) => {
            return Err(bad(
                "options netns_fd and ifname belong to attach 'veth' (a TAP has neither)".into(),
            ));
        }
        ("veth", Some(fd), Some(ifname)) => Attach::Veth {
            ifname,
            netns: crate::netns::netns_fd(fd).map_err(|e| bad(format!("option netns_fd: {e}")))?,
        },
        ("veth", None, _) => {
            return Err(bad(
                "option netns_fd: attach 'veth' needs the fd of the container's network \
                 namespace (type 'h')"
                    .into(),
            ));
        }
        ("veth", _, None) => {
            return Err(bad(
                "option ifname: attach 'veth' needs the interface name inside the container".into(),
            ));
        }
        (other, _, _) => {
            return Err(bad(format!(
                "option attach: '{other}' is not 'tap' or 'veth'"
            )));
        }
    };
    Ok(spec)
}

/// Keys ReleaseNetworkIf's `expect` takes.
pub const EXPECT_KEYS: &[&str] = &["network_handle", "attach", "ifname", "netns_fd", "metadata"];

/// `a{sv}` expectations → [`Expect`]. Unknown keys and wrong types name the key.
pub fn parse_expect(expect: &HashMap<String, OwnedValue>) -> Result<Expect, AgentError> {
    let mut out = Expect::default();
    for (key, v) in expect {
        match key.as_str() {
            "network_handle" => out.network_handle = Some(typed(key, v, "s")?),
            "attach" => out.attach = Some(typed(key, v, "s")?),
            "ifname" => out.ifname = Some(typed(key, v, "s")?),
            "netns_fd" => {
                let fd = fd_option(key, v)?;
                out.netns = Some(
                    crate::netns::netns_fd(fd)
                        .map_err(|e| bad(format!("option {key}: {e}")))?
                        .id,
                );
            }
            "metadata" => {
                let m: HashMap<String, String> = typed(key, v, "a{ss}")?;
                out.metadata = m.into_iter().collect();
            }
            other => {
                return Err(bad(format!(
                    "unknown expectation '{other}' (known: {})",
                    EXPECT_KEYS.join(", ")
                )));
            }
        }
    }
    Ok(out)
}

/// An `h` option, duplicated so it outlives the message.
fn fd_option(key: &str, v: &OwnedValue) -> Result<std::os::fd::OwnedFd, AgentError> {
    let Value::Fd(fd) = &**v else {
        return Err(bad(format!(
            "option {key}: expected type 'h', got '{}'",
            v.value_signature()
        )));
    };
    std::os::fd::AsFd::as_fd(fd)
        .try_clone_to_owned()
        .map_err(|e| bad(format!("option {key}: {e}")))
}

fn mappings_value(m: &[PortMapping]) -> Vec<(String, u16, u16, String)> {
    m.iter()
        .map(|m| {
            (
                m.protocol.to_string(),
                m.container_port,
                m.host_port,
                m.host_ip.clone(),
            )
        })
        .collect()
}

/// A dictionary answer: keys in a stable (sorted) order, so `busctl`
/// output is readable and diffable.
pub type Dict = BTreeMap<String, OwnedValue>;

/// A network's traffic (GetNetwork's `traffic`): `a{sv}` of `t` values.
pub fn traffic_value(t: &crate::agent::traffic::Traffic) -> OwnedValue {
    let d: HashMap<&str, Value<'_>> = t
        .fields()
        .into_iter()
        .map(|(k, v)| (k, Value::from(v)))
        .collect();
    Value::from(d)
        .try_to_owned()
        .expect("no fds in a traffic dict")
}

/// A network as the `a{sv}` the SPEC describes.
/// TrafficWhilePaused's details.
pub fn paused_traffic_dict(t: &crate::agent::events::PausedTraffic) -> Dict {
    let mut d = Dict::new();
    let mut put = |k: &str, v: Value<'_>| {
        d.insert(
            k.to_owned(),
            v.try_to_owned().expect("no fds in the details"),
        );
    };
    put("protocol", Value::from(t.protocol));
    put("port", Value::from(t.port));
    put("remote_ip", Value::from(t.remote_ip.to_string()));
    put("remote_port", Value::from(t.remote_port));
    put("via", Value::from(t.via));
    d
}

pub fn network_dict(info: NetworkInfo) -> Dict {
    let r = std::sync::Arc::unwrap_or_clone(info.view.record);
    let mut d = Dict::new();
    let mut put = |k: &str, v: Value<'_>| {
        d.insert(
            k.to_owned(),
            v.try_to_owned().expect("no fds in a network dict"),
        );
    };
    put("sandbox_id", Value::from(r.sandbox_id));
    put("network_handle", Value::from(r.network_handle));
    put("tap_name", Value::from(r.tap_name));
    put("tap_ifindex", Value::from(info.view.tap_ifindex as i32));
    put("sandbox_ip", Value::from(r.sandbox_ip.to_string()));
    put("guest_ip", Value::from(info.guest_ip));
    put("gateway_ip", Value::from(info.gateway_ip));
    put("guest_mac", Value::from(info.guest_mac));
    put("gateway_mac", Value::from(info.gateway_mac));
    if let Some(a) = info.guest_ipv6 {
        put("guest_ipv6", Value::from(a));
    }
    if let Some(a) = info.gateway_ipv6 {
        put("gateway_ipv6", Value::from(a));
        put("ipv6_egress", Value::from(info.ipv6_egress));
        if let Some(why) = info.ipv6_egress_reason {
            put("ipv6_egress_reason", Value::from(why));
        }
    }
    if let Some(a) = info.sandbox_ipv6 {
        put("sandbox_ipv6", Value::from(a));
    }
    put("mtu", Value::from(r.mtu));
    put(
        "port_mappings",
        Value::from(mappings_value(&r.port_mappings)),
    );
    put(
        "allow_internet_access",
        Value::from(r.allow_internet_access),
    );
    put("allow_out", Value::from(r.allow_out));
    put("deny_out", Value::from(r.deny_out));
    put(
        "metadata",
        Value::from(r.metadata.into_iter().collect::<HashMap<_, _>>()),
    );
    put("routes", Value::from(info.routes));
    put("arp_neighbors", Value::from(info.arp_neighbors));
    put("created_unix", Value::from(r.created_unix));
    if let Some(k) = r.idempotency_key {
        put("idempotency_key", Value::from(k));
    }
    if let Some(src) = r.cloned_from {
        put("cloned_from", Value::from(src));
    }
    put("paused", Value::from(r.paused));
    put("attach", Value::from(r.attach.name()));
    if let Some(o) = r.tap_owner {
        put("tap_owner_uid", Value::from(o.uid));
        if let Some(g) = o.gid {
            put("tap_owner_gid", Value::from(g));
        }
    }
    put("egress_mode", Value::from(r.egress_mode.as_str()));
    put("egress_rules", Value::from(rules_value(&r.egress_rules)));
    let bw = r.bandwidth;
    put("egress_bps", Value::from(bw.egress_bps));
    put("ingress_bps", Value::from(bw.ingress_bps));
    if bw.egress_bps != 0 {
        put(
            "egress_burst",
            Value::from(Bandwidth::burst_or_default(bw.egress_burst)),
        );
    }
    if bw.ingress_bps != 0 {
        put(
            "ingress_burst",
            Value::from(Bandwidth::burst_or_default(bw.ingress_burst)),
        );
    }
    if let AttachRecord::Veth { ifname, netns, .. } = r.attach {
        put("ifname", Value::from(ifname));
        if let Some(ns) = netns {
            put("netns", Value::from(ns.to_string()));
        }
        put("mapping_wins", Value::from(r.mapping_wins));
    }
    d
}

/// Capacity's answer as it goes on the bus: `a{sv}`, each number a `t`
/// variant and `labels` an `a{ss}` one, written straight from the
/// [`Capacity`](crate::agent::capacity::Capacity) (a scheduler polls it:
/// no map of owned strings and values is built per call to be serialized
/// and dropped).
struct CapacityReply(crate::agent::capacity::Capacity);

impl serde::Serialize for CapacityReply {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        use zbus::zvariant::as_value;
        let fields = self.0.fields();
        let mut m = s.serialize_map(Some(fields.len()))?;
        for (k, v) in fields.iter().filter(|(k, _)| *k != "labels") {
            m.serialize_entry(k, &as_value::Serialize(v))?;
        }
        m.serialize_entry("labels", &as_value::Serialize(&self.0.labels))?;
        m.end()
    }
}

impl zbus::zvariant::Type for CapacityReply {
    const SIGNATURE: &'static zbus::zvariant::Signature = <Dict as zbus::zvariant::Type>::SIGNATURE;
}

fn report_dict(r: ReconcileReport) -> Dict {
    let mut d = Dict::new();
    let mut put = |k: &str, v: Value<'_>| {
        d.insert(k.to_owned(), v.try_to_owned().expect("no fds"));
    };
    put("checked", Value::from(r.checked));
    put("repaired", Value::from(r.repaired));
    put("removed", Value::from(r.removed));
    put("errors", Value::from(r.errors));
    d
}

/// The manager object.
pub struct Manager {
    agent: Arc<Agent>,
    authority: Authority,
    /// The last event the bus mirror has applied.
    mirrored: tokio::sync::watch::Receiver<u64>,
}

impl Manager {
    /// Authorizes the caller of the message with `header` for `action`.
    async fn authorize(&self, header: &Header<'_>, action: Action) -> Result<(), Error> {
        let Some(sender) = header.sender() else {
            return Err(Error::AccessDenied(format!(
                "not authorized for {action}: the call has no sender"
            )));
        };
        let interactive = header
            .primary()
            .flags()
            .contains(Flags::AllowInteractiveAuth);
        self.authority
            .check_bus_caller(sender, action, interactive)
            .await
            .map_err(Error::from)
    }

    /// Passes `result` on; a refusal is logged first (who, what, why;
    /// rate-limited per uid, see [`crate::refusals`]).
    fn logged<T>(
        &self,
        header: &Header<'_>,
        method: &str,
        sandbox_id: &str,
        result: Result<T, Error>,
    ) -> Result<T, Error> {
        if let Err(e) = &result {
            let name = header.sender().map(|s| s.as_str()).unwrap_or("");
            let error = e.name();
            crate::refusals::note(
                crate::refusals::Caller {
                    edge: "dbus",
                    name,
                    uid: header.sender().and_then(|s| self.authority.known_uid(s)),
                    pid: None,
                },
                crate::refusals::Refusal {
                    method,
                    sandbox_id,
                    error: error.rsplit('.').next().unwrap_or(&error),
                    message: &e.to_string(),
                },
            );
        }
        result
    }

    fn info(&self, view: crate::agent::NetworkView) -> Dict {
        network_dict(self.agent.describe(view))
    }

    /// Waits until the bus mirror has applied event `seq` to the objects
    /// (the network's object exists with its properties, or is gone;
    /// InterfacesAdded/Removed and PropertiesChanged are out) before a
    /// method replies. NetworkEnsured/NetworkReleased follow the reply.
    async fn mirrored(&self, seq: u64) {
        let mut done = self.mirrored.clone();
        // Bounded: a stuck mirror must not hold every caller (the change
        // itself is done and durable; only its signals would be late).
        let wait = done.wait_for(|at| *at >= seq);
        if tokio::time::timeout(std::time::Duration::from_secs(5), wait)
            .await
            .is_err()
        {
            tracing::warn!(seq, "the bus mirror is behind; replying before its signals");
        }
    }
}

#[interface(name = "org.cube.NetworkAgent")]
impl Manager {
    /// Creates the sandbox's network, or converges it to `options`. Its
    /// object, PropertiesChanged and NetworkEnsured come from the core's
    /// event (whichever edge made the change); the reply waits for the
    /// object, NetworkEnsured follows it.
    #[zbus(out_args("network"))]
    async fn ensure_network(
        &self,
        sandbox_id: String,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Dict, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            let spec = parse_options(&options)?;
            let out = self.agent.ensure(&sandbox_id, spec).await?;
            self.mirrored(out.seq).await;
            Ok(self.info(out.view))
        }
        .await;
        self.logged(&header, "EnsureNetwork", &sandbox_id, result)
    }

    /// Replaces the network's egress rules, nothing else (a CNI
    /// attachment's: its conflist is no place for secrets). Each rule:
    /// host s, set_headers a{ss}, methods as, paths as, plain_http b.
    #[zbus(out_args("network"))]
    async fn set_egress_rules(
        &self,
        sandbox_id: String,
        rules: Vec<HashMap<String, OwnedValue>>,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Dict, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            let rules = rules_from("rules", &rules)?;
            let out = self.agent.set_egress_rules(&sandbox_id, rules).await?;
            self.mirrored(out.seq).await;
            Ok(self.info(out.view))
        }
        .await;
        self.logged(&header, "SetEgressRules", &sandbox_id, result)
    }

    /// Returns everything; false if there was no such network.
    #[zbus(out_args("released"))]
    async fn release_network(
        &self,
        sandbox_id: String,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<bool, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            match self.agent.release(&sandbox_id).await? {
                Some(seq) => {
                    self.mirrored(seq).await;
                    Ok(true)
                }
                None => Ok(false),
            }
        }
        .await;
        self.logged(&header, "ReleaseNetwork", &sandbox_id, result)
    }

    /// Releases the network only if it is what the caller expects: every key
    /// of `expect` (network_handle s, attach s, ifname s, netns_fd h, metadata
    /// a{ss}) must match, checked and released atomically; a mismatch is
    /// InvalidArgument naming the key and releases nothing. False if there was
    /// no such network. cube-cni's DEL, GC and failed-ADD cleanup use it.
    #[zbus(out_args("released"))]
    async fn release_network_if(
        &self,
        sandbox_id: String,
        expect: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<bool, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            let expect = parse_expect(&expect)?;
            match self.agent.release_if(&sandbox_id, &expect).await? {
                Some(seq) => {
                    self.mirrored(seq).await;
                    Ok(true)
                }
                None => Ok(false),
            }
        }
        .await;
        self.logged(&header, "ReleaseNetworkIf", &sandbox_id, result)
    }

    /// Re-checks one network ("" = all) against the kernel and repairs it.
    #[zbus(out_args("report"))]
    async fn reconcile_network(
        &self,
        sandbox_id: String,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Dict, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            Ok(report_dict(self.agent.reconcile(&sandbox_id).await?))
        }
        .await;
        self.logged(&header, "ReconcileNetwork", &sandbox_id, result)
    }

    #[zbus(out_args("network"))]
    async fn get_network(
        &self,
        sandbox_id: String,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Dict, Error> {
        let result = async {
            self.authorize(&header, Action::Read).await?;
            let view = self.agent.get(&sandbox_id)?;
            let traffic = self.agent.traffic(&view).await?;
            let mut d = self.info(view);
            d.insert("traffic".into(), traffic_value(&traffic));
            Ok(d)
        }
        .await;
        self.logged(&header, "GetNetwork", &sandbox_id, result)
    }

    #[zbus(out_args("networks"))]
    async fn list_networks(&self, #[zbus(header)] header: Header<'_>) -> Result<Vec<Dict>, Error> {
        let result = async {
            self.authorize(&header, Action::Read).await?;
            Ok(self
                .agent
                .list()
                .into_iter()
                .map(|v| self.info(v))
                .collect())
        }
        .await;
        self.logged(&header, "ListNetworks", "", result)
    }

    /// A fresh duplicate of the TAP fd for the VMM.
    #[zbus(out_args("tap_fd"))]
    async fn open_tap(
        &self,
        sandbox_id: String,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<zbus::zvariant::OwnedFd, Error> {
        let result = async {
            self.authorize(&header, Action::Manage).await?;
            Ok(self.agent.open_tap(&sandbox_id).await?.into())
        }
        .await;
        self.logged(&header, "OpenTap", &sandbox_id, result)
    }

    #[zbus(out_args("healthy", "checks"))]
    async fn health(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(bool, Vec<(String, bool, String)>), Error> {
        let result = async {
            self.authorize(&header, Action::Read).await?;
            Ok(self.agent.health().await)
        }
        .await;
        self.logged(&header, "Health", "", result)
    }

    /// The node's headroom (docs/observability.md "Capacity"): free
    /// addresses, TAPs, host ports; flow-table and learned-address fill;
    /// bandwidth committed against the node's totals (t values), and the
    /// node's labels (a{ss}).
    #[zbus(out_args("capacity"))]
    async fn capacity(&self, #[zbus(header)] header: Header<'_>) -> Result<CapacityReply, Error> {
        let result = async {
            self.authorize(&header, Action::Read).await?;
            Ok(CapacityReply(self.agent.capacity()))
        }
        .await;
        self.logged(&header, "Capacity", "", result)
    }

    #[zbus(property)]
    async fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }

    #[zbus(property)]
    async fn active_networks(&self) -> u32 {
        self.agent.active_networks()
    }

    #[zbus(property)]
    async fn idle_taps(&self) -> u32 {
        self.agent.idle_taps()
    }

    #[zbus(property)]
    async fn free_addresses(&self) -> u32 {
        self.agent.free_addresses()
    }

    /// The node CA's certificate (PEM) guests trust for egress rules'
    /// hosts; empty while the egress gateway does not run.
    #[zbus(property)]
    async fn egress_ca_certificate(&self) -> String {
        self.agent.egress_ca_pem().unwrap_or_default()
    }

    #[zbus(property)]
    async fn healthy(&self) -> bool {
        self.agent.health().await.0
    }

    #[zbus(signal)]
    async fn network_ensured(
        emitter: &SignalEmitter<'_>,
        sandbox_id: &str,
        network: Dict,
    ) -> zbus::Result<()>;

    #[zbus(signal)]
    async fn network_released(emitter: &SignalEmitter<'_>, sandbox_id: &str) -> zbus::Result<()>;

    /// The first packet for a paused sandbox (one per pause; dropped):
    /// `protocol`, `port` (the sandbox's), `remote_ip`, `remote_port`,
    /// `via` ("reply", "port_mapping" or "host").
    #[zbus(signal)]
    async fn traffic_while_paused(
        emitter: &SignalEmitter<'_>,
        sandbox_id: &str,
        details: Dict,
    ) -> zbus::Result<()>;
}

/// One object per network, listed by the ObjectManager on the manager.
/// It holds the view of the last event the mirror applied, so what its
/// properties say always matches the signals sent so far.
pub struct NetworkObject {
    view: crate::agent::NetworkView,
}

#[interface(name = "org.cube.NetworkAgent.Network")]
impl NetworkObject {
    #[zbus(property)]
    async fn sandbox_id(&self) -> String {
        self.view.record.sandbox_id.clone()
    }

    #[zbus(property)]
    async fn network_handle(&self) -> String {
        self.view.record.network_handle.clone()
    }

    #[zbus(property)]
    async fn sandbox_ip(&self) -> String {
        self.view.record.sandbox_ip.to_string()
    }

    #[zbus(property)]
    async fn tap_name(&self) -> String {
        self.view.record.tap_name.clone()
    }

    #[zbus(property)]
    async fn tap_ifindex(&self) -> i32 {
        self.view.tap_ifindex as i32
    }

    #[zbus(property)]
    async fn mtu(&self) -> u32 {
        self.view.record.mtu
    }

    #[zbus(property)]
    async fn port_mappings(&self) -> Vec<(String, u16, u16, String)> {
        mappings_value(&self.view.record.port_mappings)
    }

    #[zbus(property)]
    async fn allow_internet_access(&self) -> bool {
        self.view.record.allow_internet_access
    }

    #[zbus(property)]
    async fn allow_out(&self) -> Vec<String> {
        self.view.record.allow_out.clone()
    }

    #[zbus(property)]
    async fn deny_out(&self) -> Vec<String> {
        self.view.record.deny_out.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("connecting to the {bus} bus")]
    Connect {
        bus: String,
        #[source]
        source: zbus::Error,
    },
    #[error("registering objects")]
    Register(#[source] zbus::Error),
    #[error("the name {BUS_NAME} is already owned by another process on this bus")]
    NameTaken,
    #[error("requesting the name {BUS_NAME}")]
    RequestName(#[source] zbus::Error),
}

/// Connects, registers the manager, the ObjectManager and one object per
/// recovered network, then takes the well-known name (last, so no call
/// arrives before everything is in place).
pub async fn serve(agent: Arc<Agent>, bus: &BusChoice) -> Result<Connection, ServeError> {
    let connect = |source| ServeError::Connect {
        bus: String::from(bus.clone()),
        source,
    };
    let builder = || -> zbus::Result<zbus::connection::Builder<'_>> {
        match bus {
            BusChoice::System => zbus::connection::Builder::system(),
            BusChoice::Session => zbus::connection::Builder::session(),
            BusChoice::Address(a) => zbus::connection::Builder::address(a.as_str()),
        }
    };
    // Authorization asks the bus daemon and polkit from inside method
    // handlers. On the serving connection those replies would queue behind
    // the very method calls waiting for them (a deadlock under load), so
    // the authority has a connection of its own.
    let auth_conn = builder().map_err(connect)?.build().await.map_err(connect)?;
    let conn = builder().map_err(connect)?.build().await.map_err(connect)?;
    // Subscribe first, then list: every change after the list is in the
    // stream (applying one twice is harmless).
    let (events, at) = agent.subscribe();
    let (mirrored_tx, mirrored) = tokio::sync::watch::channel(at);
    // Nobody can address us by name before `request_name` below.
    let authority = Authority::new(auth_conn);
    let manager = Manager {
        agent: agent.clone(),
        authority: authority.clone(),
        mirrored,
    };
    crate::auth::set_global(authority.clone());
    // Calls are size- and signature-checked before zbus decodes them;
    // property reads need the read action like every other read.
    conn.object_server()
        .at(
            MANAGER_PATH,
            gate::ReadGate::properties(bounded::Bounded(manager), authority.clone()),
        )
        .await
        .map_err(ServeError::Register)?;
    // Recovered networks first, the ObjectManager after them, both without
    // a signal (gate::Registering).
    let started = std::time::Instant::now();
    let mut mirror =
        mirror::Mirror::new(conn.clone(), agent.clone(), mirrored_tx, authority.clone());
    let quiet = gate::Registering::start();
    let objects = mirror
        .register_all(agent.list())
        .await
        .map_err(ServeError::Register)?;
    let objects_ms = started.elapsed().as_millis() as u64;
    // GetManagedObjects returns every network: a read like ListNetworks.
    match conn
        .object_server()
        .at(
            MANAGER_PATH,
            gate::ReadGate::everything(fdo::ObjectManager, authority),
        )
        .await
    {
        Ok(_) => {}
        Err(e) if gate::Registering::is_announcement(&e) => {}
        Err(e) => return Err(ServeError::Register(e)),
    }
    drop(quiet);
    debug!(
        objects,
        objects_ms,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "network objects registered"
    );
    let reply = conn
        .request_name_with_flags(BUS_NAME, zbus::fdo::RequestNameFlags::DoNotQueue.into())
        .await;
    match reply {
        Ok(
            zbus::fdo::RequestNameReply::PrimaryOwner | zbus::fdo::RequestNameReply::AlreadyOwner,
        ) => {}
        Ok(_) | Err(zbus::Error::NameTaken) => return Err(ServeError::NameTaken),
        Err(e) => return Err(ServeError::RequestName(e)),
    }
    info!(name = BUS_NAME, "serving on the bus");
    tokio::spawn(mirror.run(events));
    Ok(conn)
}

/// Egress rules as GetNetwork shows them: header names with a digest of
/// their value (`sha256:…`), never the value.
pub fn rules_value(rules: &[crate::rules::EgressRule]) -> Vec<HashMap<String, OwnedValue>> {
    rules
        .iter()
        .map(|r| {
            let shown = r.shown();
            let mut d = HashMap::new();
            let mut put = |k: &str, v: Value<'_>| {
                if let Ok(v) = v.try_to_owned() {
                    d.insert(k.to_owned(), v);
                }
            };
            put("host", Value::from(shown.host));
            put(
                "set_headers",
                Value::from(shown.set_headers.into_iter().collect::<HashMap<_, _>>()),
            );
            put("methods", Value::from(shown.methods));
            put("paths", Value::from(shown.paths));
            put("plain_http", Value::from(shown.plain_http));
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Capacity's reply is the `a{sv}` the dictionary of owned values
    /// made (every number a `t`, labels an `a{ss}`), on the wire and
    /// read back.
    #[test]
    fn capacity_reply_is_the_dict_it_replaces() {
        use zbus::zvariant::{LE, Type, serialized::Context, to_bytes};
        let c = crate::agent::capacity::Capacity {
            networks: 3,
            addresses_free: 16378,
            egress_bps_committed: 1 << 40,
            host_flows: u64::MAX,
            labels: [("zone", "a"), ("rack", "r\"1")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into(),
            ..Default::default()
        };
        let mut old = Dict::new();
        for (k, v) in c.fields() {
            if k != "labels" {
                old.insert(k.to_owned(), OwnedValue::from(v));
            }
        }
        old.insert(
            "labels".to_owned(),
            Value::from(c.labels.clone().into_iter().collect::<HashMap<_, _>>())
                .try_to_owned()
                .unwrap(),
        );
        assert_eq!(CapacityReply::SIGNATURE, Dict::SIGNATURE);
        let ctxt = Context::new_dbus(LE, 0);
        let bytes = to_bytes(ctxt, &CapacityReply(c.clone())).unwrap();
        let (got, _): (Dict, _) = bytes.deserialize().unwrap();
        assert_eq!(got, old);
        assert_eq!(got.len(), c.fields().len());
        assert_eq!(u64::try_from(&got["host_flows"]).unwrap(), u64::MAX);
        let labels: HashMap<String, String> =
            got["labels"].try_clone().unwrap().try_into().unwrap();
        assert_eq!(labels["rack"], "r\"1");
    }

    fn opts(pairs: Vec<(&str, Value<'_>)>) -> HashMap<String, OwnedValue> {
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.try_to_owned().unwrap()))
            .collect()
    }

    #[test]
    fn parses_every_option() {
        let o = opts(vec![
            (
                "port_mappings",
                Value::from(vec![("tcp".to_string(), 80u16, 0u16, String::new())]),
            ),
            ("allow_internet_access", Value::from(false)),
            ("allow_out", Value::from(vec!["10.0.0.0/8".to_string()])),
            ("deny_out", Value::from(vec!["1.1.1.1".to_string()])),
            (
                "metadata",
                Value::from(HashMap::from([("k".to_string(), "v".to_string())])),
            ),
            ("idempotency_key", Value::from("req-1")),
            ("mtu", Value::from(1400u32)),
        ]);
        let s = parse_options(&o).unwrap();
        assert_eq!(s.port_mappings.len(), 1);
        assert_eq!(s.allow_internet_access, Some(false));
        assert_eq!(s.allow_out, vec!["10.0.0.0/8"]);
        assert_eq!(s.deny_out, vec!["1.1.1.1"]);
        assert_eq!(s.metadata.get("k").map(String::as_str), Some("v"));
        assert_eq!(s.idempotency_key.as_deref(), Some("req-1"));
        assert_eq!(s.mtu, Some(1400));
    }

    #[test]
    fn rejects_unknown_keys_and_wrong_types_naming_the_key() {
        let e = parse_options(&opts(vec![("bogus", Value::from(1u32))])).unwrap_err();
        assert!(e.to_string().contains("unknown option 'bogus'"), "{e}");
        let e = parse_options(&opts(vec![("mtu", Value::from("1400"))])).unwrap_err();
        assert!(
            e.to_string()
                .contains("option mtu: expected type 'u', got 's'"),
            "{e}"
        );
        let e = parse_options(&opts(vec![(
            "port_mappings",
            Value::from(vec!["80".to_string()]),
        )]))
        .unwrap_err();
        assert!(
            e.to_string().contains("port_mappings") && e.to_string().contains("a(sqqs)"),
            "{e}"
        );
        let e = parse_options(&opts(vec![(
            "port_mappings",
            Value::from(vec![("sctp".to_string(), 80u16, 0u16, String::new())]),
        )]))
        .unwrap_err();
        assert!(e.to_string().contains("protocol 'sctp'"), "{e}");
        let e =
            parse_options(&opts(vec![("allow_internet_access", Value::from(1i32))])).unwrap_err();
        assert!(e.to_string().contains("allow_internet_access"), "{e}");
    }

    /// The same paths as libsystemd's `sd_bus_path_encode`, asked through
    /// python3's ctypes (libsystemd0 is on every systemd host).
    #[test]
    fn paths_equal_sd_bus_path_encode() {
        let ids = [
            "sbx1",
            "1abc",
            "9",
            "a.b:c-d_e",
            "_x",
            "ABC-123",
            "x",
            "0.1",
            "a__b",
            "z9Z",
            "sbx-1.vm:7",
            "",
            "-",
            "..",
            "a1b2c3",
        ];
        let script = r#"
import ctypes, sys
l = ctypes.CDLL("libsystemd.so.0")
l.sd_bus_path_encode.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
for id in sys.argv[1:]:
    out = ctypes.c_char_p()
    assert l.sd_bus_path_encode(b"/org/cube/NetworkAgent/network", id.encode(), ctypes.byref(out)) >= 0
    print(out.value.decode())
"#;
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .args(ids)
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        let ours: Vec<String> = ids.iter().map(|i| network_path(i).to_string()).collect();
        assert_eq!(ours, theirs);
        assert_eq!(
            network_path("1abc").as_str(),
            "/org/cube/NetworkAgent/network/_31abc"
        );
    }
}
