//! The varlink wire edge: interface `org.cube.NetworkAgent` on the unix
//! socket `<runtime_dir>/org.cube.NetworkAgent` (or the socket systemd
//! passed). A small hand-rolled server: each message is a JSON object
//! terminated by a NUL byte; each connection is served by its own task and
//! handles its calls in order. Like the D-Bus edge it only translates:
//! [`Failure::reply`] is the one place where core errors become varlink
//! errors, and [`authorize`] the one place where access is decided.

pub mod activation;
pub mod convert;
pub mod report;

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use crate::agent::events::Change;
use crate::agent::{Agent, AgentError};
use convert::Object;

/// The interface this service implements (and the socket's file name).
pub const INTERFACE: &str = "org.cube.NetworkAgent";
/// The standard service interface every varlink service implements.
pub const SERVICE_INTERFACE: &str = "org.varlink.service";
/// The committed IDL of [`INTERFACE`].
pub const IDL: &str = include_str!("../../varlink/org.cube.NetworkAgent.varlink");
/// Messages (without the NUL) larger than this close the connection.
pub const MAX_MESSAGE: usize = 1 << 20;

const SERVICE_IDL: &str = "\
# The Varlink Service Interface is provided by every varlink service. It
# describes the service and the interfaces it implements.
interface org.varlink.service

# Get a list of all the interfaces a service provides and information
# about the implementation.
method GetInfo() -> (
  vendor: string,
  product: string,
  version: string,
  url: string,
  interfaces: []string
)

# Get the description of an interface that is implemented by this service.
method GetInterfaceDescription(interface: string) -> (description: string)

# The requested interface was not found.
error InterfaceNotFound (interface: string)

# The requested method was not found
error MethodNotFound (method: string)

# The interface defines the requested method, but the service does not
# implement it.
error MethodNotImplemented (method: string)

# One of the passed parameters is invalid.
error InvalidParameter (parameter: string)

# Client is denied access
error PermissionDenied ()

# Method is expected to be called with 'more' set to true, but wasn't
error ExpectedMore ()
";

/// The caller, identified once, at connect time: `SO_PEERCRED`, the
/// process's pidfd (`SO_PEERPIDFD`) and its start time read while that
/// pidfd proved the pid still meant the process that connected. Every call
/// on the connection is judged as that process; once it has exited, calls
/// are refused (its pid may belong to another process by then, which must
/// never be judged in its place).
#[derive(Debug, Clone)]
pub struct Peer {
    /// `None` if the kernel could not tell (peer in another pid namespace).
    pub pid: Option<i32>,
    pub uid: u32,
    pub gid: u32,
    /// The process's start time (field 22 of /proc/PID/stat), what polkit
    /// pairs with the pid to identify a process.
    pub start_time: Option<u64>,
    /// The connecting process itself (kernels without SO_PEERPIDFD: none).
    pidfd: Option<std::sync::Arc<OwnedFd>>,
    /// The kernel said the connecting process had exited already
    /// (`SO_PEERPIDFD` failed with ESRCH): whatever runs under its pid now
    /// is someone else, so nothing is read about it and every call is
    /// refused.
    gone: bool,
    /// How the logs name it ([`Peer::label`]), read once.
    label: std::sync::OnceLock<String>,
}

/// `SO_PEERPIDFD` (Linux 6.5).
const SO_PEERPIDFD: libc::c_int = 77;

impl Peer {
    /// Identifies the process at the other end of `stream`.
    pub fn of(stream: &UnixStream) -> io::Result<Peer> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let c = stream.peer_cred()?;
        let mut fd: libc::c_int = -1;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a live c_int.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&raw mut fd).cast(),
                &mut len,
            )
        };
        let gone = rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        // SAFETY: on success the kernel installed a new pidfd that nothing
        // else owns.
        let pidfd =
            (rc == 0 && fd >= 0).then(|| std::sync::Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }));
        let mut peer = Peer {
            pid: c.pid(),
            uid: c.uid(),
            gid: c.gid(),
            start_time: None,
            pidfd,
            gone,
            label: std::sync::OnceLock::new(),
        };
        if gone {
            return Ok(peer);
        }
        if let Some(pid) = peer.pid.and_then(|p| u32::try_from(p).ok()) {
            let start = crate::auth::process_start_time(pid).ok();
            // Read after the pidfd was taken: if the process is still
            // there now, the start time is its own.
            peer.start_time = start.filter(|_| peer.alive());
        }
        Ok(peer)
    }

    /// How the logs name the caller: its command (from /proc, as the
    /// process that connected; read at the first refusal, then kept) or,
    /// unknown, "varlink peer".
    pub fn label(&self) -> &str {
        self.label.get_or_init(|| {
            self.pid
                .filter(|_| self.alive())
                .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| "varlink peer".to_owned())
        })
    }

    /// Whether the process that connected still runs (false when the
    /// kernel said at connect time that it had exited; true when the
    /// kernel has no pidfds: then only the start time guards against pid
    /// reuse).
    fn alive(&self) -> bool {
        use std::os::fd::AsRawFd;
        if self.gone {
            return false;
        }
        let Some(fd) = &self.pidfd else {
            return true;
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one live pollfd with a zero timeout. A pidfd
        // polls readable once its process has exited.
        let rc = unsafe { libc::poll(&mut p, 1, 0) };
        rc == 0
    }
}

/// What a call wants to do, for [`authorize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Ensure, Release, Reconcile, OpenTap (`org.cube.NetworkAgent.manage`).
    Manage,
    /// Get, List, Health (`org.cube.NetworkAgent.read`).
    Read,
}

/// A refusal; becomes `org.cube.NetworkAgent.AccessDenied`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied(pub String);

/// The access-control hook every agent call passes through (SPEC §5):
/// root always; everyone else by polkit action, subject = the peer process
/// (pid + start time + uid); fail closed when polkit cannot be asked (also
/// before the bus connection is up). Varlink has no interactive flag.
pub async fn authorize(peer: &Peer, op: Operation) -> Result<(), Denied> {
    use crate::auth::{self, Action};
    let action = match op {
        Operation::Manage => Action::Manage,
        Operation::Read => Action::Read,
    };
    if peer.uid == 0 {
        return Ok(());
    }
    let Some(authority) = auth::global() else {
        return Err(Denied(format!(
            "not authorized for {action}: polkit was unreachable (no bus connection yet)"
        )));
    };
    let Some(pid) = peer
        .pid
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p > 0)
    else {
        return Err(Denied(format!(
            "not authorized for {action}: the caller's pid is unknown"
        )));
    };
    let Some(start_time) = peer.start_time else {
        return Err(Denied(format!(
            "not authorized for {action}: cannot identify the caller (no start time for pid {pid})"
        )));
    };
    if !peer.alive() {
        return Err(Denied(format!(
            "not authorized for {action}: the process that connected (pid {pid}) has exited; \
             its connection cannot act for another process"
        )));
    }
    authority
        .check_process(pid, start_time, peer.uid, action, false)
        .await
        .map_err(|e| Denied(e.to_string()))
}

/// Why a call failed, before it becomes a wire error.
#[derive(Debug)]
pub enum Failure {
    Agent(AgentError),
    AccessDenied(String),
    /// The parameter (or option) name.
    InvalidParameter(String),
    /// The fully qualified method name.
    MethodNotFound(String),
    InterfaceNotFound(String),
}

impl From<AgentError> for Failure {
    fn from(e: AgentError) -> Self {
        Failure::Agent(e)
    }
}

impl From<Denied> for Failure {
    fn from(d: Denied) -> Self {
        Failure::AccessDenied(d.0)
    }
}

impl Failure {
    /// The error reply: the one mapping from failures to varlink errors.
    pub fn reply(self) -> Value {
        let (name, parameters) = match self {
            Failure::Agent(e) => {
                let name = match &e {
                    AgentError::InvalidArgument(_) => "InvalidArgument",
                    AgentError::NotFound(_) => "NotFound",
                    AgentError::NodeFull { resource, .. } => {
                        return json!({
                            "error": format!("{INTERFACE}.NodeFull"),
                            "parameters": {"resource": resource, "message": e.to_string()},
                        });
                    }
                    AgentError::PortInUse(_) => "PortInUse",
                    AgentError::TapBusy { .. } => "TapBusy",
                    AgentError::Conflict(_) => "Conflict",
                    AgentError::Failed(_) => "Failed",
                };
                (
                    format!("{INTERFACE}.{name}"),
                    json!({"message": e.to_string()}),
                )
            }
            Failure::AccessDenied(m) => {
                (format!("{INTERFACE}.AccessDenied"), json!({"message": m}))
            }
            Failure::InvalidParameter(p) => (
                format!("{SERVICE_INTERFACE}.InvalidParameter"),
                json!({"parameter": p}),
            ),
            Failure::MethodNotFound(m) => (
                format!("{SERVICE_INTERFACE}.MethodNotFound"),
                json!({"method": m}),
            ),
            Failure::InterfaceNotFound(i) => (
                format!("{SERVICE_INTERFACE}.InterfaceNotFound"),
                json!({"interface": i}),
            ),
        };
        json!({"error": name, "parameters": parameters})
    }
}

/// A successful reply: its parameters and, for OpenTap, the fd to pass.
struct Reply {
    parameters: Value,
    fd: Option<OwnedFd>,
}

impl Reply {
    fn new(parameters: Value) -> Self {
        Reply {
            parameters,
            fd: None,
        }
    }
}

/// Every method this service answers, fully qualified.
pub const METHODS: &[&str] = &[
    "org.varlink.service.GetInfo",
    "org.varlink.service.GetInterfaceDescription",
    "org.cube.NetworkAgent.EnsureNetwork",
    "org.cube.NetworkAgent.ReleaseNetwork",
    "org.cube.NetworkAgent.ReleaseNetworkIf",
    "org.cube.NetworkAgent.ReconcileNetwork",
    "org.cube.NetworkAgent.GetNetwork",
    "org.cube.NetworkAgent.ListNetworks",
    "org.cube.NetworkAgent.OpenTap",
    "org.cube.NetworkAgent.Health",
    "org.cube.NetworkAgent.Capacity",
    "org.cube.NetworkAgent.SetEgressRules",
    "org.cube.NetworkAgent.GetEgressCA",
    WATCH,
    WATCH_FLOWS,
];

/// The subscription methods (need `"more": true`).
const WATCH: &str = "org.cube.NetworkAgent.WatchNetworks";
const WATCH_FLOWS: &str = "org.cube.NetworkAgent.WatchFlows";

/// Runs one call. Access is checked before parameters are looked at.
async fn call(agent: &Agent, peer: &Peer, method: &str, p: Object) -> Result<Reply, Failure> {
    let op = match method.strip_prefix("org.cube.NetworkAgent.") {
        Some(
            "EnsureNetwork" | "ReleaseNetwork" | "ReleaseNetworkIf" | "ReconcileNetwork"
            | "OpenTap" | "SetEgressRules",
        ) => Some(Operation::Manage),
        Some("GetNetwork" | "ListNetworks" | "Health" | "Capacity" | "GetEgressCA") => {
            Some(Operation::Read)
        }
        _ => None,
    };
    if let Some(op) = op {
        authorize(peer, op).await?;
    }
    let id = |p: &Object| -> Result<String, Failure> {
        convert::only(p, &["sandbox_id"])?;
        convert::string(p, "sandbox_id")
    };
    Ok(match method {
        "org.varlink.service.GetInfo" => {
            convert::only(&p, &[])?;
            Reply::new(json!({
                "vendor": "Cube",
                "product": env!("CARGO_PKG_NAME"),
                "version": env!("CARGO_PKG_VERSION"),
                "url": "man:cube-network-agent(8)",
                "interfaces": [SERVICE_INTERFACE, INTERFACE],
            }))
        }
        "org.varlink.service.GetInterfaceDescription" => {
            convert::only(&p, &["interface"])?;
            let description = match convert::string(&p, "interface")?.as_str() {
                INTERFACE => IDL,
                SERVICE_INTERFACE => SERVICE_IDL,
                other => return Err(Failure::InterfaceNotFound(other.to_owned())),
            };
            Reply::new(json!({ "description": description }))
        }
        "org.cube.NetworkAgent.EnsureNetwork" => {
            convert::only(&p, &["sandbox_id", "options"])?;
            let sandbox_id = convert::string(&p, "sandbox_id")?;
            let spec = convert::options(p.get("options"))?;
            let out = agent.ensure(&sandbox_id, spec).await?;
            Reply::new(json!({ "network": convert::network(agent.describe(out.view)) }))
        }
        "org.cube.NetworkAgent.ReleaseNetwork" => {
            let released = agent.release(&id(&p)?).await?.is_some();
            Reply::new(json!({ "released": released }))
        }
        "org.cube.NetworkAgent.ReleaseNetworkIf" => {
            convert::only(&p, &["sandbox_id", "expect"])?;
            let sandbox_id = convert::string(&p, "sandbox_id")?;
            let expect = convert::expect(p.get("expect"))?;
            let released = agent.release_if(&sandbox_id, &expect).await?.is_some();
            Reply::new(json!({ "released": released }))
        }
        "org.cube.NetworkAgent.ReconcileNetwork" => {
            let report = agent.reconcile(&id(&p)?).await?;
            Reply::new(json!({ "report": convert::report(report) }))
        }
        "org.cube.NetworkAgent.GetNetwork" => {
            let view = agent.get(&id(&p)?)?;
            let traffic = agent.traffic(&view).await?;
            let mut network = convert::network(agent.describe(view));
            network["traffic"] = convert::traffic(&traffic);
            Reply::new(json!({ "network": network }))
        }
        "org.cube.NetworkAgent.ListNetworks" => {
            convert::only(&p, &[])?;
            let networks: Vec<Value> = agent
                .list()
                .into_iter()
                .map(|v| convert::network(agent.describe(v)))
                .collect();
            Reply::new(json!({ "networks": networks }))
        }
        "org.cube.NetworkAgent.OpenTap" => {
            let fd = agent.open_tap(&id(&p)?).await?;
            Reply {
                parameters: json!({ "tap_fd": 0 }),
                fd: Some(fd),
            }
        }
        "org.cube.NetworkAgent.Capacity" => {
            convert::only(&p, &[])?;
            Reply::new(json!({ "capacity": convert::capacity(&agent.capacity()) }))
        }
        "org.cube.NetworkAgent.SetEgressRules" => {
            convert::only(&p, &["sandbox_id", "rules"])?;
            let id = convert::string(&p, "sandbox_id")?;
            let rules = convert::rules(p.get("rules"))?;
            let out = agent.set_egress_rules(&id, rules).await?;
            Reply::new(json!({ "network": convert::network(agent.describe(out.view)) }))
        }
        "org.cube.NetworkAgent.GetEgressCA" => {
            convert::only(&p, &[])?;
            match agent.egress_ca_pem() {
                Some(pem) => Reply::new(json!({ "certificate": pem })),
                None => {
                    return Err(Failure::Agent(crate::agent::AgentError::Failed(format!(
                        "the egress gateway does not run: {}",
                        agent
                            .egress_gateway_error()
                            .unwrap_or_else(|| "not started yet".into())
                    ))));
                }
            }
        }
        "org.cube.NetworkAgent.Health" => {
            convert::only(&p, &[])?;
            let (healthy, checks) = agent.health().await;
            Reply::new(json!({ "healthy": healthy, "checks": convert::checks(checks) }))
        }
        other => {
            return Err(match other.rsplit_once('.') {
                Some((iface, _)) if iface == INTERFACE || iface == SERVICE_INTERFACE => {
                    Failure::MethodNotFound(other.to_owned())
                }
                Some((iface, _)) => Failure::InterfaceNotFound(iface.to_owned()),
                None => Failure::MethodNotFound(other.to_owned()),
            });
        }
    })
}

/// What to do after a message.
enum Next {
    Continue,
    Close(&'static str),
}

/// One NUL-terminated message (without the NUL): parse, run, reply.
async fn message(agent: &Agent, peer: &Peer, stream: &mut UnixStream, msg: &[u8]) -> Next {
    let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(msg) else {
        return Next::Close("message is not a JSON object");
    };
    let Some(Value::String(method)) = m.remove("method") else {
        return Next::Close("message has no method");
    };
    let oneway = m.get("oneway").and_then(Value::as_bool).unwrap_or(false);
    if method == WATCH || method == WATCH_FLOWS {
        let more = m.get("more").and_then(Value::as_bool).unwrap_or(false);
        let params = match m.remove("parameters") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(p)) => p,
            Some(_) => {
                return send(
                    stream,
                    &Failure::InvalidParameter("parameters".into()).reply(),
                )
                .await;
            }
        };
        if method == WATCH_FLOWS {
            return watch_flows(agent, peer, stream, more, params).await;
        }
        return watch(agent, peer, stream, more, params).await;
    }
    // "more" needs no handling elsewhere: only the watches stream, so
    // any other single reply (without "continues") is the whole answer.
    let params = match m.remove("parameters") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(p)) => Ok(p),
        Some(_) => Err(Failure::InvalidParameter("parameters".into())),
    };
    let sandbox_id = params
        .as_ref()
        .ok()
        .and_then(|p| p.get("sandbox_id"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let result = match params {
        Ok(p) => call(agent, peer, &method, p).await,
        Err(f) => Err(f),
    };
    let result = result.map_err(|f| {
        let reply = f.reply();
        let error = reply["error"].as_str().unwrap_or("");
        // The message a person reads, not the reply's JSON (errors without
        // one, such as InvalidParameter, say what they carry).
        let message = match reply["parameters"].get("message").and_then(Value::as_str) {
            Some(m) => m.to_owned(),
            None => reply["parameters"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| format!("{k} {}", v.as_str().unwrap_or(&v.to_string())))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default(),
        };
        note_refusal("varlink", peer, &method, &sandbox_id, error, &message);
        reply
    });
    debug!(
        method,
        uid = peer.uid,
        pid = peer.pid,
        ok = result.is_ok(),
        "varlink call"
    );
    if oneway {
        return Next::Continue;
    }
    let (reply, fd) = match result {
        Ok(r) => (json!({ "parameters": r.parameters }), r.fd),
        Err(reply) => (reply, None),
    };
    let mut bytes = serde_json::to_vec(&reply).expect("a reply always serialises");
    bytes.push(0);
    let sent = match fd {
        None => stream.write_all(&bytes).await,
        Some(fd) => send_with_fd(stream, &bytes, &fd).await,
    };
    match sent {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close("writing the reply failed"),
    }
}

/// Logs a refused call ([`crate::refusals`], rate-limited per uid) as the
/// D-Bus edge does: who (the process that connected, its uid and pid), the
/// method, the sandbox, the error's short name and the message (an
/// access refusal names the polkit action). `edge`: "varlink" (the
/// agent's socket) or "report" (the metrics socket).
pub(crate) fn note_refusal(
    edge: &str,
    peer: &Peer,
    method: &str,
    sandbox_id: &str,
    error: &str,
    message: &str,
) {
    crate::refusals::note(
        crate::refusals::Caller {
            edge,
            name: peer.label(),
            uid: Some(peer.uid),
            pid: peer.pid,
        },
        crate::refusals::Refusal {
            method,
            sandbox_id,
            error: error.rsplit('.').next().unwrap_or(error),
            message,
        },
    );
}

/// Sends one reply (NUL-terminated JSON).
async fn send(stream: &mut UnixStream, reply: &Value) -> Next {
    let mut bytes = serde_json::to_vec(reply).expect("a reply always serialises");
    bytes.push(0);
    match stream.write_all(&bytes).await {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close("writing the reply failed"),
    }
}

/// WatchNetworks: the networks as they are, then every change in the order
/// the core made it (the same stream the D-Bus objects and signals follow),
/// until the client hangs up. A subscriber that falls more than
/// `events::BACKLOG` changes behind gets `EventsLost` and is closed (it
/// should subscribe again).
async fn watch(agent: &Agent, peer: &Peer, stream: &mut UnixStream, more: bool, p: Object) -> Next {
    if !more {
        return send(
            stream,
            &json!({"error": format!("{SERVICE_INTERFACE}.ExpectedMore"), "parameters": {}}),
        )
        .await;
    }
    if let Err(d) = authorize(peer, Operation::Read).await {
        note_refusal("varlink", peer, WATCH, "", "AccessDenied", &d.0);
        return send(stream, &Failure::from(d).reply()).await;
    }
    if let Err(f) = convert::only(&p, &[]) {
        return send(stream, &f.reply()).await;
    }
    let (mut rx, at) = agent.subscribe();
    let networks: Vec<Value> = agent
        .list()
        .into_iter()
        .map(|v| convert::network(agent.describe(v)))
        .collect();
    let first = json!({
        "parameters": {"event": {"seq": at, "kind": "current", "networks": networks}},
        "continues": true,
    });
    if let Next::Close(why) = send(stream, &first).await {
        return Next::Close(why);
    }
    let mut probe = [0u8; 1];
    // A client that shut down only its writing side (`printf ... | socat`)
    // still reads: keep streaming; a write to a peer that closed ends it.
    let mut half_closed = false;
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            read = stream.read(&mut probe), if !half_closed => match read {
                Ok(0) => {
                    half_closed = true;
                    continue;
                }
                // Data mid-stream breaks the protocol; an error: gone.
                _ => return Next::Close("watcher left"),
            },
        };
        let ev = match ev {
            Ok(ev) => ev,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                let lost = json!({
                    "error": format!("{INTERFACE}.EventsLost"),
                    "parameters": {"missed": missed},
                });
                let _ = send(stream, &lost).await;
                return Next::Close("watcher fell behind");
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                return Next::Close("agent stopping");
            }
        };
        let mut event = json!({"seq": ev.seq, "kind": ev.change.kind()});
        match &ev.change {
            Change::Node => continue,
            Change::Ensured { view, .. } => {
                event["sandbox_id"] = json!(view.record.sandbox_id);
                event["network"] = convert::network(agent.describe(view.clone()));
            }
            Change::Repaired { view, repairs } => {
                event["sandbox_id"] = json!(view.record.sandbox_id);
                event["network"] = convert::network(agent.describe(view.clone()));
                event["repairs"] = json!(repairs);
            }
            Change::Released { sandbox_id } => event["sandbox_id"] = json!(sandbox_id),
            Change::TrafficWhilePaused {
                sandbox_id,
                traffic,
            } => {
                event["sandbox_id"] = json!(sandbox_id);
                event["traffic"] = json!({
                    "protocol": traffic.protocol,
                    "port": traffic.port,
                    "remote_ip": traffic.remote_ip.to_string(),
                    "remote_port": traffic.remote_port,
                    "via": traffic.via,
                });
            }
        }
        let reply = json!({"parameters": {"event": event}, "continues": true});
        if let Next::Close(why) = send(stream, &reply).await {
            return Next::Close(why);
        }
    }
}

/// One reply of a WatchFlows stream, appended to `out` (NUL-terminated).
fn push_reply(out: &mut Vec<u8>, parameters: Value, continues: bool) {
    let reply = if continues {
        json!({"parameters": parameters, "continues": true})
    } else {
        json!({ "parameters": parameters })
    };
    serde_json::to_writer(&mut *out, &reply).expect("a reply always serialises");
    out.push(0);
}

/// Writes `bytes` (whole replies).
async fn send_bytes(stream: &mut UnixStream, bytes: &[u8]) -> Next {
    match stream.write_all(bytes).await {
        Ok(()) => Next::Continue,
        Err(_) => Next::Close("writing the reply failed"),
    }
}

/// WatchFlows: the kept flow records of the last `since_seconds` the filter
/// takes, then (with `follow`) every new one, as the hub delivers them to
/// this watcher's own bounded queue: a watcher that stops reading blocks
/// only its own connection (it is never waited for: its queue fills and
/// it is told how many records it lost). Nothing is locked while a reply is
/// written.
async fn watch_flows(
    agent: &Agent,
    peer: &Peer,
    stream: &mut UnixStream,
    more: bool,
    p: Object,
) -> Next {
    if !more {
        return send(
            stream,
            &json!({"error": format!("{SERVICE_INTERFACE}.ExpectedMore"), "parameters": {}}),
        )
        .await;
    }
    if let Err(d) = authorize(peer, Operation::Read).await {
        let id = p.get("sandbox_id").and_then(Value::as_str).unwrap_or("");
        note_refusal("varlink", peer, WATCH_FLOWS, id, "AccessDenied", &d.0);
        return send(stream, &Failure::from(d).reply()).await;
    }
    match convert::flow_watch(&p) {
        Ok(w) => stream_flows(agent.flows(), stream, &w).await,
        Err(f) => send(stream, &f.reply()).await,
    }
}

/// WatchFlows' replies once the call is allowed and its parameters fine.
async fn stream_flows(
    hub: &crate::flows::FlowHub,
    stream: &mut UnixStream,
    w: &convert::FlowWatch,
) -> Next {
    // Subscribed before the history is read: a record published in
    // between is in both, and skipped the second time (below).
    let mut sub = w.follow.then(|| hub.subscribe(w.filter.clone()));
    let history = if w.since_seconds == 0 {
        vec![]
    } else {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        hub.history(
            &w.filter,
            now.saturating_sub(w.since_seconds * 1_000_000_000),
        )
    };
    // The history goes out in writes of about 64 KiB, not one per record.
    let mut out = Vec::with_capacity(64 * 1024);
    for rec in &history {
        push_reply(&mut out, json!({"flow": convert::flow(rec)}), true);
        if out.len() >= 64 * 1024 {
            if let Next::Close(why) = send_bytes(stream, &out).await {
                return Next::Close(why);
            }
            out.clear();
        }
    }
    let Some(sub) = sub.as_mut() else {
        push_reply(&mut out, json!({}), false);
        return send_bytes(stream, &out).await;
    };
    if !out.is_empty()
        && let Next::Close(why) = send_bytes(stream, &out).await
    {
        return Next::Close(why);
    }
    // The records both in the history and in the subscription are the
    // first ones the subscription delivers; once one is not in the
    // history, none after it is.
    let mut overlap = !history.is_empty();
    let mut probe = [0u8; 1];
    // A client that shut down only its writing side (`printf ... | socat`)
    // still reads: keep streaming; a write to a peer that closed ends it.
    let mut half_closed = false;
    loop {
        let d = tokio::select! {
            d = sub.next() => d,
            read = stream.read(&mut probe), if !half_closed => match read {
                Ok(0) => {
                    half_closed = true;
                    continue;
                }
                // Data mid-stream breaks the protocol; an error: gone.
                _ => return Next::Close("watcher left"),
            },
        };
        let parameters = match d {
            crate::flows::Delivery::Record(rec) => {
                if overlap {
                    let seen = history
                        .iter()
                        .rev()
                        .any(|h| Arc::ptr_eq(h, &rec) || **h == *rec);
                    if seen {
                        continue;
                    }
                    overlap = false;
                }
                json!({"flow": convert::flow(&rec)})
            }
            crate::flows::Delivery::Lost(n) => json!({ "lost": n }),
            crate::flows::Delivery::Closed => return Next::Close("agent stopping"),
        };
        out.clear();
        push_reply(&mut out, parameters, true);
        if let Next::Close(why) = send_bytes(stream, &out).await {
            return Next::Close(why);
        }
    }
}

/// Writes `data` with `fd` attached (SCM_RIGHTS) to its first bytes.
async fn send_with_fd(stream: &mut UnixStream, data: &[u8], fd: &OwnedFd) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let fds = [fd.as_raw_fd()];
    let sent = loop {
        stream.writable().await?;
        let r = stream.try_io(Interest::WRITABLE, || {
            let iov = [io::IoSlice::new(data)];
            let cmsg = [ControlMessage::ScmRights(&fds)];
            sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &cmsg,
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)
        });
        match r {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    stream.write_all(&data[sent..]).await
}

/// Bytes all connections together may hold in their receive buffers.
pub const MAX_BUFFERED_TOTAL: usize = 16 << 20;
/// What an idle connection keeps for reading; a larger buffer is given
/// back once its message is handled.
const IDLE_BUFFER: usize = 4096;

/// What every varlink connection together may take from the agent.
#[derive(Default)]
struct Budget {
    buffered: std::sync::atomic::AtomicUsize,
    per_uid: std::sync::Mutex<std::collections::HashMap<u32, u32>>,
    /// Connection limits (config `varlink_max_connections`,
    /// `varlink_max_connections_per_uid`), set by [`serve`].
    max_total: std::sync::atomic::AtomicU32,
    max_per_uid: std::sync::atomic::AtomicU32,
}

static BUDGET: std::sync::LazyLock<Budget> = std::sync::LazyLock::new(Budget::default);

impl Budget {
    fn open(&'static self, uid: u32) -> Result<Share, String> {
        use std::sync::atomic::Ordering;
        let (max_total, max_per_uid) = (
            self.max_total.load(Ordering::Relaxed),
            self.max_per_uid.load(Ordering::Relaxed),
        );
        let mut m = self.per_uid.lock().unwrap_or_else(|p| p.into_inner());
        let total: u32 = m.values().sum();
        if total >= max_total {
            return Err(format!(
                "the agent has {total} varlink connections open, the limit is {max_total} \
                 (varlink_max_connections)"
            ));
        }
        let n = m.entry(uid).or_default();
        if *n >= max_per_uid {
            return Err(format!(
                "uid {uid} has {n} varlink connections open, the limit is {max_per_uid} \
                 (varlink_max_connections_per_uid)"
            ));
        }
        *n += 1;
        Ok(Share {
            budget: self,
            uid,
            charged: 0,
        })
    }
}

/// One connection's part of the [`Budget`], given back on drop.
struct Share {
    budget: &'static Budget,
    uid: u32,
    charged: usize,
}

impl Share {
    /// Accounts for a receive buffer of `capacity` bytes.
    fn resize(&mut self, capacity: usize) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if capacity > self.charged {
            let more = capacity - self.charged;
            let before = self.budget.buffered.fetch_add(more, Ordering::Relaxed);
            if before + more > MAX_BUFFERED_TOTAL {
                self.budget.buffered.fetch_sub(more, Ordering::Relaxed);
                return Err(format!(
                    "the agent holds {before} bytes of unfinished varlink messages, \
                     the limit for all connections is {MAX_BUFFERED_TOTAL}"
                ));
            }
        } else {
            self.budget
                .buffered
                .fetch_sub(self.charged - capacity, Ordering::Relaxed);
        }
        self.charged = capacity;
        Ok(())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let _ = self.resize(0);
        let mut m = self
            .budget
            .per_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.uid);
            }
        }
    }
}

/// Tells the peer why it is cut off, then closes. The refusal is logged
/// (rate-limited). What the peer already sent is read and dropped for a
/// moment first: closing with unread data would reset the connection, and
/// a client that was still writing its request would see a broken pipe
/// instead of the error.
async fn refuse(stream: &mut UnixStream, peer: &Peer, why: String) {
    note_refusal("varlink", peer, "(connection)", "", "LimitsExceeded", &why);
    let reply = json!({
        "error": format!("{INTERFACE}.LimitsExceeded"),
        "parameters": {"message": why},
    });
    let mut bytes = serde_json::to_vec(&reply).expect("a reply always serialises");
    bytes.push(0);
    if stream.write_all(&bytes).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async {
        let mut left: usize = 64 * 1024;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
}

/// Serves one connection until EOF, an I/O error or malformed input.
async fn connection(agent: Arc<Agent>, mut stream: UnixStream) {
    let peer = match Peer::of(&stream) {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "varlink: no peer credentials; closing");
            return;
        }
    };
    let mut share = match BUDGET.open(peer.uid) {
        Ok(s) => s,
        Err(why) => return refuse(&mut stream, &peer, why).await,
    };
    let mut buf: Vec<u8> = Vec::new();
    // Bytes of `buf` already known to hold no NUL.
    let mut scanned = 0;
    loop {
        while let Some(pos) = buf[scanned..].iter().position(|&b| b == 0) {
            let end = scanned + pos;
            if end > MAX_MESSAGE {
                break;
            }
            let next = message(&agent, &peer, &mut stream, &buf[..end]).await;
            if let Next::Close(why) = next {
                debug!(
                    uid = peer.uid,
                    pid = peer.pid,
                    why,
                    "varlink: closing connection"
                );
                return;
            }
            buf.drain(..=end);
            scanned = 0;
        }
        if buf.is_empty() && buf.capacity() > IDLE_BUFFER {
            buf = Vec::new();
        }
        scanned = buf.len();
        if buf.len() > MAX_MESSAGE {
            debug!(
                uid = peer.uid,
                pid = peer.pid,
                "varlink: message over {MAX_MESSAGE} bytes; closing connection"
            );
            return;
        }
        // Read straight into `buf`, growing it only as a message needs.
        if buf.capacity() - buf.len() < IDLE_BUFFER / 2 {
            buf.reserve(if buf.is_empty() {
                IDLE_BUFFER
            } else {
                buf.capacity()
            });
        }
        if let Err(why) = share.resize(buf.capacity()) {
            return refuse(&mut stream, &peer, why).await;
        }
        match stream.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

async fn accept_loop(agent: Arc<Agent>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(agent.clone(), stream));
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(error = %e, "varlink: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{path} exists and is not a socket")]
    NotASocket { path: PathBuf },
    #[error("binding the varlink socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("using the varlink socket")]
    Listener(#[source] io::Error),
}

/// `passed` (the socket systemd passed), or a fresh socket at
/// `<runtime_dir>/org.cube.NetworkAgent` (a stale socket file is replaced;
/// mode 0666, since access is decided per call).
fn listener(
    runtime_dir: &Path,
    passed: Option<std::os::unix::net::UnixListener>,
) -> Result<UnixListener, ServeError> {
    if let Some(l) = passed {
        info!("varlink: using the socket passed by systemd");
        l.set_nonblocking(true).map_err(ServeError::Listener)?;
        return UnixListener::from_std(l).map_err(ServeError::Listener);
    }
    let path = runtime_dir.join(INTERFACE);
    let l = bind_fresh(&path)?;
    info!(path = %path.display(), "varlink: listening");
    Ok(l)
}

/// A fresh socket at `path` (a stale socket there is replaced, anything
/// else refused), mode 0666: access is decided per call. Shared by the
/// agent's socket and the metrics socket (`report`).
pub(crate) fn bind_fresh(path: &Path) -> Result<UnixListener, ServeError> {
    let bind = |source| ServeError::Bind {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(bind)?,
        Ok(_) => {
            return Err(ServeError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind(e)),
    }
    let l = UnixListener::bind(path).map_err(bind)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(bind)?;
    Ok(l)
}

/// Serves varlink in the background on `passed` (from
/// [`activation::listener_from`]), else on a
/// socket of our own in the runtime directory.
pub fn serve(
    agent: Arc<Agent>,
    passed: Option<std::os::unix::net::UnixListener>,
) -> Result<(), ServeError> {
    use std::sync::atomic::Ordering;
    let cfg = agent.config();
    BUDGET
        .max_total
        .store(cfg.varlink_max_connections, Ordering::Relaxed);
    BUDGET
        .max_per_uid
        .store(cfg.varlink_max_connections_per_uid, Ordering::Relaxed);
    let l = listener(&cfg.runtime_dir, passed)?;
    tokio::spawn(accept_loop(agent, l));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idl_declares_every_method_served() {
        let declared: Vec<String> = IDL
            .lines()
            .filter_map(|l| l.strip_prefix("method "))
            .filter_map(|l| l.split('(').next())
            .map(|m| format!("{INTERFACE}.{}", m.trim()))
            .collect();
        let served: Vec<&str> = METHODS
            .iter()
            .copied()
            .filter(|m| m.starts_with("org.cube."))
            .collect();
        assert_eq!(declared, served);
        assert!(IDL.contains("interface org.cube.NetworkAgent\n"));
        for e in [
            "InvalidArgument",
            "NotFound",
            "PortInUse",
            "TapBusy",
            "Conflict",
            "Failed",
            "AccessDenied",
        ] {
            assert!(IDL.contains(&format!("error {e} (message: string)")), "{e}");
        }
    }

    /// A caller whose process exited (and was reaped) before the agent
    /// identified it is gone: the agent must not read the start time of
    /// whatever process has its pid by then.
    #[tokio::test]
    async fn a_peer_that_exited_before_it_was_identified_is_refused() {
        let dir = std::env::temp_dir().join(format!("cna-peer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let listener = UnixListener::bind(&path).unwrap();
        // A process that connects and exits at once; reaped before accept.
        let status = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])",
            ])
            .arg(&path)
            .status()
            .expect("python3");
        assert!(status.success());
        let (stream, _) = listener.accept().await.unwrap();
        let peer = Peer::of(&stream).unwrap();
        // Kernels 6.5-6.15 refuse SO_PEERPIDFD with ESRCH here (`gone`);
        // later ones hand out a pidfd of the exited process, which polls
        // readable. Either way: not alive.
        assert!(peer.gone || peer.pidfd.is_some(), "{peer:?}");
        assert!(!peer.alive());
        assert_eq!(peer.start_time, None, "no start time read for its pid");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn errors_map_one_to_one() {
        let r = Failure::Agent(AgentError::NotFound("x".into())).reply();
        assert_eq!(r["error"], "org.cube.NetworkAgent.NotFound");
        assert_eq!(r["parameters"]["message"], "no network for sandbox 'x'");
        let r = Failure::InvalidParameter("mtu".into()).reply();
        assert_eq!(r["error"], "org.varlink.service.InvalidParameter");
        assert_eq!(r["parameters"]["parameter"], "mtu");
        let r = Failure::from(Denied("no".into())).reply();
        assert_eq!(r["error"], "org.cube.NetworkAgent.AccessDenied");
    }
    fn rec(id: &str, port: u16, refused: bool) -> crate::flows::FlowRecord {
        use crate::flows::{Direction, Endpoint, FlowEvent, FlowRecord, Reason};
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        FlowRecord {
            time_unix_ns: now,
            sandbox_id: id.into(),
            event: if refused {
                FlowEvent::Refused
            } else {
                FlowEvent::Start
            },
            family: 4,
            protocol: "tcp".into(),
            direction: Direction::Egress,
            guest: Endpoint {
                ip: "169.254.68.6".parse().unwrap(),
                port,
            },
            remote: Endpoint {
                ip: "203.0.113.9".parse().unwrap(),
                port: 443,
            },
            node: None,
            refused: refused.then_some(Reason::Policy),
            dns_name: None,
            end: None,
        }
    }

    fn hub(queue: usize) -> Arc<crate::flows::FlowHub> {
        let limits = crate::flows::HubLimits {
            subscriber_queue: queue,
            ..Default::default()
        };
        crate::flows::FlowHub::new(limits, crate::flows::FlowLog::Off)
    }

    /// Reads replies until `n` (or the end of the stream).
    async fn replies(c: &mut UnixStream, buf: &mut Vec<u8>, n: usize) -> Vec<Value> {
        let mut out = vec![];
        while out.len() < n {
            if let Some(pos) = buf.iter().position(|&b| b == 0) {
                let m: Vec<u8> = buf.drain(..=pos).collect();
                out.push(serde_json::from_slice(&m[..pos]).unwrap());
                continue;
            }
            let mut chunk = [0u8; 65536];
            match c.read(&mut chunk).await.unwrap() {
                0 => break,
                k => buf.extend_from_slice(&chunk[..k]),
            }
        }
        out
    }

    fn watch(since_seconds: u64, follow: bool, denied: bool) -> convert::FlowWatch {
        convert::FlowWatch {
            filter: crate::flows::Filter {
                sandbox_id: None,
                denied,
            },
            since_seconds,
            follow,
        }
    }

    /// Without follow: the history the filter takes, then a last reply
    /// without parameters and without "continues"; the connection serves
    /// on.
    #[tokio::test]
    async fn watch_flows_history_only_ends_the_stream() {
        let h = hub(16);
        h.publish(rec("a", 1, false));
        h.publish(rec("a", 2, true));
        h.publish(rec("b", 3, true));
        let (mut s, mut c) = UnixStream::pair().unwrap();
        let next = stream_flows(&h, &mut s, &watch(3600, false, true)).await;
        assert!(matches!(next, Next::Continue));
        drop(s);
        let r = replies(&mut c, &mut vec![], usize::MAX).await;
        assert_eq!(r.len(), 3, "{r:?}");
        assert_eq!(r[0]["continues"], true);
        assert_eq!(r[0]["parameters"]["flow"]["guest"]["port"], 2);
        assert_eq!(r[0]["parameters"]["flow"]["reason"], "policy");
        assert_eq!(r[1]["parameters"]["flow"]["sandbox_id"], "b");
        assert_eq!(r[2], json!({"parameters": {}}));
        // No history asked for: only the last reply.
        let (mut s, mut c) = UnixStream::pair().unwrap();
        stream_flows(&h, &mut s, &watch(0, false, false)).await;
        drop(s);
        let r = replies(&mut c, &mut vec![], usize::MAX).await;
        assert_eq!(r, [json!({"parameters": {}})]);
    }

    /// Following: the history first, each record once, then new ones; a
    /// watcher that stops reading never holds up the publisher: it loses
    /// records, counted and told, and every record is either delivered or
    /// counted lost.
    #[tokio::test]
    async fn watch_flows_follows_and_a_stalled_watcher_loses_records() {
        let h = hub(8);
        h.publish(rec("a", 1, false));
        let (mut s, mut c) = UnixStream::pair().unwrap();
        let task = {
            let h = h.clone();
            tokio::spawn(async move { stream_flows(&h, &mut s, &watch(60, true, false)).await })
        };
        let mut buf = vec![];
        let r = replies(&mut c, &mut buf, 1).await;
        assert_eq!(r[0]["parameters"]["flow"]["guest"]["port"], 1);
        assert_eq!(r[0]["continues"], true);
        // 20,000 records while the watcher reads nothing: far more than
        // its queue and the socket's buffer hold. Publishing never waits.
        let started = std::time::Instant::now();
        for i in 0..20_000u32 {
            h.publish(rec("a", (i % 60_000) as u16 + 2, false));
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        let (mut flows, mut lost) = (0u64, 0u64);
        while flows + lost < 20_000 {
            let r = replies(&mut c, &mut buf, 1).await;
            let p = &r[0]["parameters"];
            assert_eq!(r[0]["continues"], true, "{r:?}");
            match (p.get("flow"), p.get("lost")) {
                (Some(f), None) => {
                    assert_ne!(f["guest"]["port"], 1, "the history's record came twice");
                    flows += 1;
                }
                (None, Some(n)) => lost += n.as_u64().unwrap(),
                _ => panic!("{r:?}"),
            }
        }
        assert_eq!(flows + lost, 20_000);
        assert!(lost > 0 && flows > 0, "flows {flows}, lost {lost}");
        assert_eq!(h.totals().2, lost);
        h.close();
        assert!(matches!(task.await.unwrap(), Next::Close("agent stopping")));
    }
}
