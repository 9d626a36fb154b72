//! `cubenetctl`: the operator CLI for cube-network-agent, in the style of
//! `networkctl` / `resolvectl`. It talks to `org.cube.NetworkAgent` over
//! D-Bus and nothing else; every result it prints is what the agent said.
//!
//! Exit codes (a contract for scripts, also in `--help` and the man page):
//! 0 success, 1 the agent returned an error (health: degraded; reconcile:
//! the report lists errors), 2 usage error, 3 no such network, 4 the agent
//! is unreachable. `open-tap` execs its command, whose status is then the
//! status; if the exec itself fails: 127 (not found) or 126.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::process::ExitCode;

use serde_json::{Map, Value as Json, json};
use zbus::Connection;
use zbus::zvariant::{OwnedValue, Value};

const NAME: &str = "org.cube.NetworkAgent";
const PATH: &str = "/org/cube/NetworkAgent";
const IFACE: &str = "org.cube.NetworkAgent";
const ERROR_PREFIX: &str = "org.cube.NetworkAgent.Error.";

const EXIT_OK: u8 = 0;
const EXIT_AGENT: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_NOT_FOUND: u8 = 3;
const EXIT_UNREACHABLE: u8 = 4;

/// The fd number `open-tap` hands the TAP to its command on.
const TAP_FD: i32 = 3;

/// Something that ends the run: printed as `cubenetctl: MSG` on stderr.
#[derive(Debug)]
struct Failure {
    code: u8,
    msg: String,
}

impl Failure {
    fn usage(msg: impl Into<String>) -> Failure {
        Failure {
            code: EXIT_USAGE,
            msg: format!("{} (see 'cubenetctl --help')", msg.into()),
        }
    }
}

type Res<T> = Result<T, Failure>;

// ---------------------------------------------------------------------------
// Command table and help texts

#[derive(Debug)]
struct CommandDef {
    name: &'static str,
    args: &'static str,
    summary: &'static str,
    help: &'static str,
}

const COMMANDS: &[CommandDef] = &[
    CommandDef {
        name: "list",
        args: "",
        summary: "List sandbox networks (the default command)",
        help: "Prints one line per network: SANDBOX, SANDBOX-IP, TAP, MTU, PORTS
(container port → host port) and CNI (for networks made by cube-cni:
CONTAINER/IFNAME@NETNS; '-' otherwise), then 'N networks.'. With --json, a JSON
array of network objects (the agent's a{sv} with the same keys).",
    },
    CommandDef {
        name: "status",
        args: "ID",
        summary: "Show everything about one network",
        help: "Prints every field of network ID as aligned 'Key: value' lines. With
--json, the network object. Exit status 3 if there is no such network.",
    },
    CommandDef {
        name: "ensure",
        args: "ID [OPTIONS...]",
        summary: "Create a network, or converge it to OPTIONS",
        help: "Calls EnsureNetwork and prints the resulting network like 'status'.
EnsureNetwork is declarative: an option left out means its default, so
repeating the command returns the same network and a changed one
converges it (same address and TAP).

Options:
  --port=PROTO:CONTAINER[:HOST[:HOSTIP]]
                          Map a port (repeatable). PROTO is tcp or udp;
                          HOST 0 or empty: the agent picks one; HOSTIP
                          empty: the agent's default bind address.
                          e.g. --port tcp:80  --port udp:53:25053:127.0.0.1
  --allow-out=CIDR        Allow egress to CIDR (repeatable)
  --deny-out=CIDR         Deny egress to CIDR (repeatable)
  --no-internet           No internet access
  --mtu=N                 TAP MTU (default: the agent's)
  --metadata=KEY=VALUE    Attach metadata (repeatable)
  --idempotency-key=KEY   A repeat with the same key returns the stored
                          network without re-applying anything",
    },
    CommandDef {
        name: "release",
        args: "ID",
        summary: "Release a network",
        help: "Calls ReleaseNetwork. Prints 'released ID' and exits 0, or prints
'ID: no such network' and exits 3 if it did not exist. With --json,
{\"sandbox_id\": ID, \"released\": true|false} (same exit codes).",
    },
    CommandDef {
        name: "reconcile",
        args: "[ID]",
        summary: "Re-check networks against the kernel, repair drift",
        help: "Calls ReconcileNetwork for ID, or for every network without ID, and
prints the report: checked, repaired, removed, errors. Exit status 1
if the report lists errors.",
    },
    CommandDef {
        name: "health",
        args: "",
        summary: "Show the agent's health checks",
        help: "Prints a CHECK / OK / DETAIL table and 'healthy' or 'degraded'.
Exit status 0 if healthy, 1 if degraded. With --json,
{\"healthy\": BOOL, \"checks\": [{\"name\", \"ok\", \"detail\"}...]}.",
    },
    CommandDef {
        name: "open-tap",
        args: "ID -- COMMAND [ARGS...]",
        summary: "Run COMMAND with the network's TAP as fd 3",
        help: "Calls OpenTap (a fresh duplicate of the agent's TAP fd: IFF_TAP,
IFF_NO_PI, 12-byte virtio-net header) and execs COMMAND with it as
file descriptor 3, e.g.

  cubenetctl open-tap sbx-1 -- qemu-system-x86_64 -netdev tap,id=n0,fd=3,vnet_hdr=on ...

COMMAND's exit status is then the status; if COMMAND cannot be
executed: 127 (not found) or 126 (other errors).",
    },
];

fn find_command(name: &str) -> Option<&'static CommandDef> {
    COMMANDS.iter().find(|c| c.name == name)
}

const OPTIONS_HELP: &str = "Options:
  -h --help               Show this help ('cubenetctl COMMAND --help': that command's)
     --version            Show the version
     --bus=BUS            system (default), session, or a D-Bus address such as
                          unix:path=/run/dbus/system_bus_socket; default from
                          $CUBENETCTL_BUS
     --json[=short|pretty]
                          JSON output (short: one line)
     --no-legend          No column headers and summary lines";

const EXIT_HELP: &str = "Exit status:
  0  success (health: healthy)
  1  the agent returned an error, printed as 'cubenetctl: NAME: MESSAGE'
     (health: degraded; reconcile: the report lists errors)
  2  usage error
  3  no such network (NotFound, or release of a network that did not exist)
  4  the agent is unreachable (no bus, name not owned, access denied)";

fn main_help() -> String {
    let mut s = String::from(
        "cubenetctl [OPTIONS...] COMMAND [ARGS...]\n\n\
         Query and control cube-network-agent (org.cube.NetworkAgent).\n\nCommands:\n",
    );
    for c in COMMANDS {
        let head = if c.args.is_empty() {
            c.name.to_owned()
        } else {
            format!("{} {}", c.name, c.args)
        };
        if head.len() > 22 {
            s.push_str(&format!("  {head}\n  {:22}  {}\n", "", c.summary));
        } else {
            s.push_str(&format!("  {head:22}  {}\n", c.summary));
        }
    }
    s.push('\n');
    s.push_str(OPTIONS_HELP);
    s.push_str("\n\n");
    s.push_str(EXIT_HELP);
    s.push_str("\n\nSee 'man cubenetctl' (docs/cubenetctl.1.md) for more.\n");
    s
}

fn command_help(c: &CommandDef) -> String {
    format!(
        "cubenetctl [OPTIONS...] {} {}\n\n{}.\n\n{}\n\nGlobal options: --bus=BUS, --json[=short|pretty], --no-legend (see 'cubenetctl --help').\n\n{}\n",
        c.name, c.args, c.summary, c.help, EXIT_HELP
    )
}

// ---------------------------------------------------------------------------
// Argument parsing

#[derive(Debug, Clone, PartialEq, Eq)]
enum Bus {
    System,
    Session,
    Address(String),
}

impl Bus {
    fn describe(&self) -> String {
        match self {
            Bus::System => "system bus".into(),
            Bus::Session => "session bus".into(),
            Bus::Address(a) => format!("bus at {a}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JsonMode {
    Off,
    Short,
    Pretty,
}

#[derive(Debug)]
struct Global {
    bus: Bus,
    json: JsonMode,
    legend: bool,
}

type PortMapping = (String, u16, u16, String);

#[derive(Debug, Default)]
struct EnsureOpts {
    ports: Vec<PortMapping>,
    allow_out: Vec<String>,
    deny_out: Vec<String>,
    no_internet: bool,
    mtu: Option<u32>,
    metadata: Vec<(String, String)>,
    idempotency_key: Option<String>,
}

#[derive(Debug)]
enum Cmd {
    List,
    Status(String),
    Ensure(String, EnsureOpts),
    Release(String),
    Reconcile(String),
    Health,
    OpenTap(String, Vec<String>),
}

#[derive(Debug)]
enum Parsed {
    Help(Option<&'static CommandDef>),
    Version,
    Run(Global, Cmd),
}

/// Raw `ensure` flag values, checked only after `--help` had its chance.
#[derive(Default)]
struct RawEnsure {
    ports: Vec<String>,
    allow_out: Vec<String>,
    deny_out: Vec<String>,
    no_internet: bool,
    mtu: Option<String>,
    metadata: Vec<String>,
    idempotency_key: Option<String>,
}

fn parse_bus(s: &str, origin: &str) -> Res<Bus> {
    match s {
        "system" => Ok(Bus::System),
        "session" => Ok(Bus::Session),
        a if a.contains(':') && a.contains('=') => Ok(Bus::Address(a.to_owned())),
        other => Err(Failure::usage(format!(
            "{origin} '{other}': expected system, session or a D-Bus address (unix:path=...)"
        ))),
    }
}

fn parse_json_mode(v: Option<&str>) -> Res<JsonMode> {
    match v {
        None | Some("short") => Ok(JsonMode::Short),
        Some("pretty") => Ok(JsonMode::Pretty),
        Some("off") => Ok(JsonMode::Off),
        Some(o) => Err(Failure::usage(format!(
            "--json={o}: expected short, pretty or off"
        ))),
    }
}

fn port_number(what: &str, s: &str) -> Result<u16, String> {
    if s.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{what} '{s}' is not a number"));
    }
    s.parse::<u16>()
        .map_err(|_| format!("{what} {s} is out of range (0-65535)"))
}

/// `PROTO:CONTAINER[:HOST[:HOSTIP]]`.
fn parse_port(s: &str) -> Result<PortMapping, String> {
    let fail = |m: String| format!("--port {s}: {m}");
    let mut parts = s.splitn(4, ':');
    let proto = parts.next().unwrap_or_default();
    if proto.is_empty() {
        return Err(fail(
            "protocol is empty (expected PROTO:CONTAINER[:HOST[:HOSTIP]], e.g. tcp:80)".into(),
        ));
    }
    let proto = proto.to_ascii_lowercase();
    if proto != "tcp" && proto != "udp" {
        return Err(fail(format!("protocol '{proto}' is not 'tcp' or 'udp'")));
    }
    let Some(container) = parts.next() else {
        return Err(fail(
            "container port is missing (expected PROTO:CONTAINER[:HOST[:HOSTIP]], e.g. tcp:80)"
                .into(),
        ));
    };
    let container = port_number("container port", container).map_err(fail)?;
    let host = match parts.next() {
        None | Some("") => 0,
        Some(h) => port_number("host port", h).map_err(fail)?,
    };
    let ip = parts.next().unwrap_or_default();
    if !ip.is_empty() && ip.parse::<std::net::IpAddr>().is_err() {
        return Err(fail(format!("host IP '{ip}' is not an IP address")));
    }
    Ok((proto, container, host, ip.to_owned()))
}

fn build_ensure(raw: RawEnsure) -> Res<EnsureOpts> {
    let mut o = EnsureOpts {
        allow_out: raw.allow_out,
        deny_out: raw.deny_out,
        no_internet: raw.no_internet,
        idempotency_key: raw.idempotency_key,
        ..EnsureOpts::default()
    };
    for p in &raw.ports {
        o.ports.push(parse_port(p).map_err(Failure::usage)?);
    }
    if let Some(m) = raw.mtu {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Failure::usage(format!("--mtu '{m}' is not a number")));
        }
        o.mtu = Some(
            m.parse()
                .map_err(|_| Failure::usage(format!("--mtu {m} is out of range")))?,
        );
    }
    for kv in &raw.metadata {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => o.metadata.push((k.to_owned(), v.to_owned())),
            _ => {
                return Err(Failure::usage(format!(
                    "--metadata {kv}: expected KEY=VALUE with a non-empty KEY"
                )));
            }
        }
    }
    Ok(o)
}

fn parse_args(args: Vec<String>, env_bus: Option<String>) -> Res<Parsed> {
    let mut it = args.into_iter();
    let mut command: Option<&'static CommandDef> = None;
    let mut positional: Vec<String> = vec![];
    let mut trailing: Option<Vec<String>> = None;
    let mut help = false;
    let mut version = false;
    let mut json = JsonMode::Off;
    let mut legend = true;
    let mut bus: Option<Bus> = None;
    let mut raw = RawEnsure::default();

    while let Some(arg) = it.next() {
        if arg == "--" {
            trailing = Some(it.by_ref().collect());
            break;
        }
        if arg.len() > 1 && arg.starts_with('-') {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
                _ => (arg.clone(), None),
            };
            // Flags that take a value: `--flag=V` or `--flag V`.
            let mut value = |inline: Option<String>| -> Res<String> {
                match inline {
                    Some(v) => Ok(v),
                    None => it
                        .next()
                        .ok_or_else(|| Failure::usage(format!("{flag} needs a value"))),
                }
            };
            let no_value = |inline: &Option<String>| -> Res<()> {
                match inline {
                    Some(_) => Err(Failure::usage(format!("{flag} takes no value"))),
                    None => Ok(()),
                }
            };
            let is_ensure = command.is_some_and(|c| c.name == "ensure");
            match flag.as_str() {
                "-h" | "--help" => help = true,
                "--version" => {
                    no_value(&inline)?;
                    version = true;
                }
                "--json" => json = parse_json_mode(inline.as_deref())?,
                "--no-legend" => {
                    no_value(&inline)?;
                    legend = false;
                }
                "--bus" => bus = Some(parse_bus(&value(inline)?, "--bus")?),
                "--port" if is_ensure => raw.ports.push(value(inline)?),
                "--allow-out" if is_ensure => raw.allow_out.push(value(inline)?),
                "--deny-out" if is_ensure => raw.deny_out.push(value(inline)?),
                "--no-internet" if is_ensure => {
                    no_value(&inline)?;
                    raw.no_internet = true;
                }
                "--mtu" if is_ensure => raw.mtu = Some(value(inline)?),
                "--metadata" if is_ensure => raw.metadata.push(value(inline)?),
                "--idempotency-key" if is_ensure => raw.idempotency_key = Some(value(inline)?),
                "--port" | "--allow-out" | "--deny-out" | "--no-internet" | "--mtu"
                | "--metadata" | "--idempotency-key" => {
                    return Err(Failure::usage(format!(
                        "{flag} is an option of 'ensure' (after the command: cubenetctl ensure ID {flag} ...)"
                    )));
                }
                _ => return Err(Failure::usage(format!("unknown option '{flag}'"))),
            }
            continue;
        }
        match command {
            None => {
                command = Some(
                    find_command(&arg)
                        .ok_or_else(|| Failure::usage(format!("unknown command '{arg}'")))?,
                );
            }
            Some(c) if c.name == "open-tap" && positional.len() == 1 => {
                // `open-tap ID COMMAND ...` without `--`: the rest is COMMAND's.
                let mut rest = vec![arg];
                rest.extend(it.by_ref());
                trailing = Some(rest);
                break;
            }
            Some(_) => positional.push(arg),
        }
    }

    if help {
        return Ok(Parsed::Help(command));
    }
    if version {
        return Ok(Parsed::Version);
    }
    let bus = match (bus, env_bus) {
        (Some(b), _) => b,
        (None, Some(e)) if !e.is_empty() => parse_bus(&e, "$CUBENETCTL_BUS")?,
        _ => Bus::System,
    };
    let global = Global { bus, json, legend };
    let c = command.unwrap_or(&COMMANDS[0]);
    if trailing.is_some() && c.name != "open-tap" {
        return Err(Failure::usage(format!(
            "'{}' takes no command after '--'",
            c.name
        )));
    }
    let want = |n: usize| -> Res<()> {
        if positional.len() < n {
            Err(Failure::usage(format!(
                "'{}' needs {} (usage: cubenetctl {} {})",
                c.name,
                c.args.split_whitespace().next().unwrap_or("an argument"),
                c.name,
                c.args
            )))
        } else if positional.len() > n {
            Err(Failure::usage(format!(
                "'{}': unexpected argument '{}'",
                c.name, positional[n]
            )))
        } else {
            Ok(())
        }
    };
    let cmd = match c.name {
        "list" => {
            want(0)?;
            Cmd::List
        }
        "health" => {
            want(0)?;
            Cmd::Health
        }
        "status" => {
            want(1)?;
            Cmd::Status(positional.remove(0))
        }
        "release" => {
            want(1)?;
            Cmd::Release(positional.remove(0))
        }
        "reconcile" => {
            if positional.len() > 1 {
                want(1)?;
            }
            Cmd::Reconcile(positional.pop().unwrap_or_default())
        }
        "ensure" => {
            want(1)?;
            Cmd::Ensure(positional.remove(0), build_ensure(raw)?)
        }
        "open-tap" => {
            want(1)?;
            let argv = trailing.unwrap_or_default();
            if argv.is_empty() {
                return Err(Failure::usage(
                    "'open-tap' needs a command to run (usage: cubenetctl open-tap ID -- COMMAND [ARGS...])",
                ));
            }
            Cmd::OpenTap(positional.remove(0), argv)
        }
        other => unreachable!("command table entry {other} not handled"),
    };
    Ok(Parsed::Run(global, cmd))
}

// ---------------------------------------------------------------------------
// D-Bus

async fn connect(bus: &Bus) -> Res<Connection> {
    let unreachable = |e: zbus::Error| Failure {
        code: EXIT_UNREACHABLE,
        msg: format!("cannot connect to the {}: {e}", bus.describe()),
    };
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system().map_err(unreachable)?,
        Bus::Session => zbus::connection::Builder::session().map_err(unreachable)?,
        Bus::Address(a) => zbus::connection::Builder::address(a.as_str())
            .map_err(|e| Failure::usage(format!("--bus '{a}': not a usable D-Bus address: {e}")))?,
    };
    builder.build().await.map_err(unreachable)
}

/// Maps a failed call to an exit code and `NAME: message`.
fn call_failure(e: zbus::Error, bus: &Bus) -> Failure {
    match e {
        zbus::Error::MethodError(name, msg, _) => {
            let full = name.as_str();
            let short = full.rsplit('.').next().unwrap_or(full);
            let msg = msg.unwrap_or_default();
            let code = if let Some(agent_err) = full.strip_prefix(ERROR_PREFIX) {
                if agent_err == "NotFound" {
                    EXIT_NOT_FOUND
                } else {
                    EXIT_AGENT
                }
            } else {
                match short {
                    "ServiceUnknown" | "NameHasNoOwner" | "AccessDenied" | "NoReply"
                    | "Disconnected" | "NoServer" | "Timeout" | "TimedOut" | "LimitsExceeded" => {
                        EXIT_UNREACHABLE
                    }
                    _ => EXIT_AGENT,
                }
            };
            let hint = if code == EXIT_UNREACHABLE {
                format!(
                    " (is cube-network-agent running on the {}?)",
                    bus.describe()
                )
            } else {
                String::new()
            };
            Failure {
                code,
                msg: format!("{short}: {msg}{hint}"),
            }
        }
        other => Failure {
            code: EXIT_UNREACHABLE,
            msg: format!("talking to {NAME} on the {}: {other}", bus.describe()),
        },
    }
}

struct Agent {
    conn: Connection,
    bus: Bus,
}

impl Agent {
    async fn call<B, R>(&self, method: &str, body: &B) -> Res<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        let reply = self
            .conn
            .call_method(Some(NAME), PATH, Some(IFACE), method, body)
            .await
            .map_err(|e| call_failure(e, &self.bus))?;
        reply.body().deserialize().map_err(|e| Failure {
            code: EXIT_AGENT,
            msg: format!("{method}: unexpected reply from the agent: {e}"),
        })
    }
}

type Dict = HashMap<String, OwnedValue>;

// ---------------------------------------------------------------------------
// Values → JSON → text

fn to_json(v: &Value<'_>) -> Json {
    match v {
        Value::U8(n) => json!(n),
        Value::Bool(b) => json!(b),
        Value::I16(n) => json!(n),
        Value::U16(n) => json!(n),
        Value::I32(n) => json!(n),
        Value::U32(n) => json!(n),
        Value::I64(n) => json!(n),
        Value::U64(n) => json!(n),
        Value::F64(n) => json!(n),
        Value::Str(s) => json!(s.as_str()),
        Value::Signature(s) => json!(s.to_string()),
        Value::ObjectPath(p) => json!(p.as_str()),
        Value::Value(inner) => to_json(inner),
        Value::Array(a) => Json::Array(a.inner().iter().map(to_json).collect()),
        Value::Dict(d) => Json::Object(
            d.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Value::Str(s) => s.as_str().to_owned(),
                        other => to_json(other).to_string(),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        Value::Structure(s) => Json::Array(s.fields().iter().map(to_json).collect()),
        Value::Fd(fd) => json!(fd.as_raw_fd()),
    }
}

fn dict_json(d: &Dict) -> Json {
    Json::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
}

fn print_json(mode: JsonMode, v: &Json) {
    let s = match mode {
        JsonMode::Pretty => serde_json::to_string_pretty(v),
        _ => serde_json::to_string(v),
    }
    .expect("JSON values serialize");
    println!("{s}");
}

fn jstr(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        Json::Null => String::new(),
        other => other.to_string(),
    }
}

/// One `port_mappings` entry: `tcp 80→20000` (any host address),
/// `udp 53→127.0.0.1:25053`.
fn port_text(m: &Json) -> String {
    let f = |i: usize| m.get(i).map(jstr).unwrap_or_default();
    let ip = f(3);
    // The wildcard address is the common case: keep the line short.
    if ip.is_empty() || ip == "0.0.0.0" || ip == "::" {
        format!("{} {}→{}", f(0), f(1), f(2))
    } else {
        format!("{} {}→{ip}:{}", f(0), f(1), f(2))
    }
}

fn ports_text(v: Option<&Json>) -> String {
    let list: Vec<String> = v
        .and_then(Json::as_array)
        .map(|a| a.iter().map(port_text).collect())
        .unwrap_or_default();
    if list.is_empty() {
        "-".into()
    } else {
        list.join(", ")
    }
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn time_text(secs: i64) -> String {
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02} {:02}:{:02}:{:02} UTC",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// A field's value as display lines (empty lists: `-`).
fn value_lines(key: &str, v: &Json) -> Vec<String> {
    let lines: Vec<String> = match (key, v) {
        ("port_mappings", Json::Array(a)) => a.iter().map(port_text).collect(),
        ("routes", Json::Array(a)) => a
            .iter()
            .map(|r| {
                let f = |i: usize| r.get(i).map(jstr).unwrap_or_default();
                let via = if f(1).is_empty() || f(1) == "0.0.0.0" {
                    String::new()
                } else {
                    format!(" via {}", f(1))
                };
                format!("{}{via} dev {}", f(0), f(2))
            })
            .collect(),
        ("arp_neighbors", Json::Array(a)) => a
            .iter()
            .map(|r| {
                let f = |i: usize| r.get(i).map(jstr).unwrap_or_default();
                format!("{} lladdr {} dev {}", f(0), f(1), f(2))
            })
            .collect(),
        ("created_unix", Json::Number(n)) => match n.as_i64() {
            Some(t) => vec![format!("{} ({t})", time_text(t))],
            None => vec![n.to_string()],
        },
        (_, Json::Bool(b)) => vec![if *b { "yes" } else { "no" }.into()],
        (_, Json::Array(a)) => a
            .iter()
            .map(|x| match x {
                Json::Array(parts) => parts.iter().map(jstr).collect::<Vec<_>>().join(" "),
                other => jstr(other),
            })
            .collect(),
        (_, Json::Object(o)) => o.iter().map(|(k, v)| format!("{k}={}", jstr(v))).collect(),
        (_, other) => vec![jstr(other)],
    };
    if lines.is_empty() {
        vec!["-".into()]
    } else {
        lines
    }
}

/// Known fields in display order with their labels; others follow by key.
const NETWORK_FIELDS: &[(&str, &str)] = &[
    ("sandbox_id", "Sandbox"),
    ("network_handle", "Handle"),
    ("sandbox_ip", "Sandbox IP"),
    ("tap_name", "TAP"),
    ("tap_ifindex", "TAP ifindex"),
    ("mtu", "MTU"),
    ("guest_ip", "Guest IP"),
    ("gateway_ip", "Gateway IP"),
    ("guest_mac", "Guest MAC"),
    ("gateway_mac", "Gateway MAC"),
    ("port_mappings", "Ports"),
    ("allow_internet_access", "Internet"),
    ("allow_out", "Allow out"),
    ("deny_out", "Deny out"),
    ("routes", "Routes"),
    ("arp_neighbors", "ARP neighbors"),
    ("metadata", "Metadata"),
    ("idempotency_key", "Idempotency key"),
    ("created_unix", "Created"),
];

const REPORT_FIELDS: &[(&str, &str)] = &[
    ("checked", "Checked"),
    ("repaired", "Repaired"),
    ("removed", "Removed"),
    ("errors", "Errors"),
];

/// `Label: value` lines, labels right-aligned like `networkctl status`;
/// continuation lines of multi-line values are indented to match.
fn key_values(obj: &Map<String, Json>, fields: &[(&str, &str)]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![];
    for (key, label) in fields {
        if let Some(v) = obj.get(*key) {
            rows.push(((*label).to_owned(), value_lines(key, v)));
        }
    }
    for (key, v) in obj {
        if !fields.iter().any(|(k, _)| k == key) {
            rows.push((key.clone(), value_lines(key, v)));
        }
    }
    let width = rows
        .iter()
        .map(|(l, _)| l.chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (label, lines) in rows {
        for (i, line) in lines.iter().enumerate() {
            if i == 0 {
                out.push_str(&format!("{label:>width$}: {line}\n"));
            } else {
                out.push_str(&format!("{:width$}  {line}\n", ""));
            }
        }
    }
    out
}

/// Columns padded to their widest cell; the last column is not padded.
/// Where a CNI attachment came from, from the metadata cube-cni records:
/// `CONTAINER/IFNAME@NETNS` (container id shortened to 12 characters, as
/// runtimes show it); "-" for networks made by VMM launchers.
fn cni_text(metadata: Option<&Json>) -> String {
    let m = |k: &str| metadata.and_then(|m| m.get(k)).and_then(Json::as_str);
    match (m("cni.container_id"), m("cni.ifname"), m("cni.netns")) {
        (Some(c), Some(i), netns) => {
            let short: String = c.chars().take(12).collect();
            format!("{short}/{i}@{}", netns.unwrap_or("-"))
        }
        _ => "-".into(),
    }
}

fn table(header: Option<&[&str]>, rows: &[Vec<String>]) -> String {
    let ncols = header
        .map(|h| h.len())
        .or_else(|| rows.first().map(Vec::len))
        .unwrap_or(0);
    let mut widths = vec![0usize; ncols];
    let all = header
        .map(|h| h.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .into_iter()
        .chain(rows.iter().cloned());
    let all: Vec<Vec<String>> = all.collect();
    for r in &all {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &all {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$} ", w = widths[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------
// Commands

enum Outcome {
    Exit(u8),
    Exec(OwnedFd, Vec<String>),
}

fn show_network(g: &Global, net: &Dict) {
    let j = dict_json(net);
    if g.json != JsonMode::Off {
        print_json(g.json, &j);
    } else if let Json::Object(o) = &j {
        print!("{}", key_values(o, NETWORK_FIELDS));
    }
}

fn ensure_options(o: &EnsureOpts) -> HashMap<&'static str, Value<'static>> {
    let mut m: HashMap<&'static str, Value<'static>> = HashMap::new();
    if !o.ports.is_empty() {
        m.insert("port_mappings", Value::from(o.ports.clone()));
    }
    if !o.allow_out.is_empty() {
        m.insert("allow_out", Value::from(o.allow_out.clone()));
    }
    if !o.deny_out.is_empty() {
        m.insert("deny_out", Value::from(o.deny_out.clone()));
    }
    if o.no_internet {
        m.insert("allow_internet_access", Value::from(false));
    }
    if let Some(mtu) = o.mtu {
        m.insert("mtu", Value::from(mtu));
    }
    if !o.metadata.is_empty() {
        let md: HashMap<String, String> = o.metadata.iter().cloned().collect();
        m.insert("metadata", Value::from(md));
    }
    if let Some(k) = &o.idempotency_key {
        m.insert("idempotency_key", Value::from(k.clone()));
    }
    m
}

async fn run(g: &Global, cmd: Cmd) -> Res<Outcome> {
    let agent = Agent {
        conn: connect(&g.bus).await?,
        bus: g.bus.clone(),
    };
    match cmd {
        Cmd::List => {
            let mut nets: Vec<Dict> = agent.call("ListNetworks", &()).await?;
            let id = |d: &Dict| {
                d.get("sandbox_id")
                    .map(|v| jstr(&to_json(v)))
                    .unwrap_or_default()
            };
            nets.sort_by_key(id);
            let js: Vec<Json> = nets.iter().map(dict_json).collect();
            if g.json != JsonMode::Off {
                print_json(g.json, &Json::Array(js));
                return Ok(Outcome::Exit(EXIT_OK));
            }
            let rows: Vec<Vec<String>> = js
                .iter()
                .map(|n| {
                    let f = |k: &str| n.get(k).map(jstr).unwrap_or_else(|| "-".into());
                    vec![
                        f("sandbox_id"),
                        f("sandbox_ip"),
                        f("tap_name"),
                        f("mtu"),
                        ports_text(n.get("port_mappings")),
                        cni_text(n.get("metadata")),
                    ]
                })
                .collect();
            let header: &[&str] = &["SANDBOX", "SANDBOX-IP", "TAP", "MTU", "PORTS", "CNI"];
            if g.legend {
                print!("{}", table(Some(header), &rows));
                println!("\n{} networks.", rows.len());
            } else if !rows.is_empty() {
                print!("{}", table(None, &rows));
            }
            Ok(Outcome::Exit(EXIT_OK))
        }
        Cmd::Status(id) => {
            let net: Dict = agent.call("GetNetwork", &(id.as_str(),)).await?;
            show_network(g, &net);
            Ok(Outcome::Exit(EXIT_OK))
        }
        Cmd::Ensure(id, o) => {
            let net: Dict = agent
                .call("EnsureNetwork", &(id.as_str(), ensure_options(&o)))
                .await?;
            show_network(g, &net);
            Ok(Outcome::Exit(EXIT_OK))
        }
        Cmd::Release(id) => {
            let released: bool = agent.call("ReleaseNetwork", &(id.as_str(),)).await?;
            if g.json != JsonMode::Off {
                print_json(g.json, &json!({"sandbox_id": id, "released": released}));
            } else if released {
                println!("released {id}");
            } else {
                eprintln!("{id}: no such network");
            }
            Ok(Outcome::Exit(if released {
                EXIT_OK
            } else {
                EXIT_NOT_FOUND
            }))
        }
        Cmd::Reconcile(id) => {
            let report: Dict = agent.call("ReconcileNetwork", &(id.as_str(),)).await?;
            let j = dict_json(&report);
            let errors = j
                .get("errors")
                .and_then(Json::as_array)
                .is_some_and(|e| !e.is_empty());
            if g.json != JsonMode::Off {
                print_json(g.json, &j);
            } else if let Json::Object(o) = &j {
                print!("{}", key_values(o, REPORT_FIELDS));
            }
            Ok(Outcome::Exit(if errors { EXIT_AGENT } else { EXIT_OK }))
        }
        Cmd::Health => {
            let (healthy, checks): (bool, Vec<(String, bool, String)>) =
                agent.call("Health", &()).await?;
            if g.json != JsonMode::Off {
                let checks: Vec<Json> = checks
                    .iter()
                    .map(|(n, ok, d)| json!({"name": n, "ok": ok, "detail": d}))
                    .collect();
                print_json(g.json, &json!({"healthy": healthy, "checks": checks}));
            } else {
                let rows: Vec<Vec<String>> = checks
                    .iter()
                    .map(|(n, ok, d)| {
                        vec![n.clone(), if *ok { "yes" } else { "no" }.into(), d.clone()]
                    })
                    .collect();
                let header: &[&str] = &["CHECK", "OK", "DETAIL"];
                print!("{}", table(g.legend.then_some(header), &rows));
                if g.legend {
                    println!("\n{}", if healthy { "healthy" } else { "degraded" });
                }
            }
            Ok(Outcome::Exit(if healthy { EXIT_OK } else { EXIT_AGENT }))
        }
        Cmd::OpenTap(id, argv) => {
            let fd: zbus::zvariant::OwnedFd = agent.call("OpenTap", &(id.as_str(),)).await?;
            Ok(Outcome::Exec(OwnedFd::from(fd), argv))
        }
    }
}

/// Puts `tap` on fd 3 (without CLOEXEC) and execs `argv`; returns only on
/// failure, with the exit code to use.
fn exec_with_tap(tap: OwnedFd, argv: &[String]) -> Failure {
    let cargs: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(cargs) = cargs else {
        return Failure::usage("open-tap: an argument contains a NUL byte");
    };
    if tap.as_raw_fd() == TAP_FD {
        // Already in place: keep it open across the exec.
        let _ = tap.into_raw_fd();
    } else {
        // SAFETY: dup2 on a valid open fd; fd 3, if open, is nothing we still
        // use (the bus connection is closed), and dup2 replaces it atomically.
        let r = unsafe { libc::dup2(tap.as_raw_fd(), TAP_FD) };
        if r < 0 {
            return Failure {
                code: EXIT_AGENT,
                msg: format!(
                    "open-tap: dup2 to fd {TAP_FD}: {}",
                    std::io::Error::last_os_error()
                ),
            };
        }
        drop(tap);
    }
    // SAFETY: fd 3 was just made valid above and stays open until the exec.
    let fd3 = unsafe { BorrowedFd::borrow_raw(TAP_FD) };
    if let Err(e) = nix::fcntl::fcntl(
        fd3,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    ) {
        return Failure {
            code: EXIT_AGENT,
            msg: format!("open-tap: clearing FD_CLOEXEC on fd {TAP_FD}: {e}"),
        };
    }
    // Rust's runtime ignores SIGPIPE; the command should get the default back.
    // SAFETY: restoring the default disposition installs no Rust handler.
    let _ = unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        )
    };
    let err = match nix::unistd::execvp(&cargs[0], &cargs) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    Failure {
        code: if err == nix::errno::Errno::ENOENT {
            127
        } else {
            126
        },
        msg: format!("{}: {}", argv[0], err.desc()),
    }
}

fn fail(f: Failure) -> ExitCode {
    eprintln!("cubenetctl: {}", f.msg);
    ExitCode::from(f.code)
}

fn main() -> ExitCode {
    let mut args = vec![];
    for a in std::env::args_os().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(a) => return fail(Failure::usage(format!("argument {a:?} is not UTF-8"))),
        }
    }
    let env_bus = std::env::var("CUBENETCTL_BUS").ok();
    let (global, cmd) = match parse_args(args, env_bus) {
        Err(f) => return fail(f),
        Ok(Parsed::Help(None)) => {
            print!("{}", main_help());
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Help(Some(c))) => {
            print!("{}", command_help(c));
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!("cubenetctl {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Run(g, c)) => (g, c),
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return fail(Failure {
                code: EXIT_AGENT,
                msg: format!("starting the runtime: {e}"),
            });
        }
    };
    let outcome = rt.block_on(run(&global, cmd));
    // Closes the bus connection before anything is exec'ed.
    drop(rt);
    match outcome {
        Ok(Outcome::Exit(code)) => ExitCode::from(code),
        Ok(Outcome::Exec(fd, argv)) => fail(exec_with_tap(fd, &argv)),
        Err(f) => fail(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Res<Parsed> {
        parse_args(args.iter().map(|s| s.to_string()).collect(), None)
    }

    #[test]
    fn ports_parse_with_specific_errors() {
        assert_eq!(
            parse_port("tcp:80").unwrap(),
            ("tcp".into(), 80, 0, "".into())
        );
        assert_eq!(
            parse_port("UDP:53:25053:127.0.0.1").unwrap(),
            ("udp".into(), 53, 25053, "127.0.0.1".into())
        );
        assert_eq!(
            parse_port("tcp:80::10.0.0.1").unwrap(),
            ("tcp".into(), 80, 0, "10.0.0.1".into())
        );
        let e = parse_port("tcp:80:x").unwrap_err();
        assert_eq!(e, "--port tcp:80:x: host port 'x' is not a number");
        assert!(
            parse_port("sctp:80")
                .unwrap_err()
                .contains("protocol 'sctp'")
        );
        assert!(
            parse_port("tcp")
                .unwrap_err()
                .contains("container port is missing")
        );
        assert!(
            parse_port("tcp:70000")
                .unwrap_err()
                .contains("out of range")
        );
        assert!(
            parse_port("tcp:80:1:nope")
                .unwrap_err()
                .contains("host IP 'nope'")
        );
    }

    #[test]
    fn parses_commands_and_global_options_anywhere() {
        match parse(&["ensure", "a", "--json", "--port=tcp:80", "--mtu", "1400"]).unwrap() {
            Parsed::Run(g, Cmd::Ensure(id, o)) => {
                assert_eq!(g.json, JsonMode::Short);
                assert_eq!(id, "a");
                assert_eq!(o.ports.len(), 1);
                assert_eq!(o.mtu, Some(1400));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(&[]).unwrap(), Parsed::Run(_, Cmd::List)));
        assert!(matches!(
            parse(&["ensure", "--help", "--port", "bad"]).unwrap(),
            Parsed::Help(Some(c)) if c.name == "ensure"
        ));
        match parse(&["open-tap", "x", "--", "sh", "-c", "true"]).unwrap() {
            Parsed::Run(_, Cmd::OpenTap(id, argv)) => {
                assert_eq!(id, "x");
                assert_eq!(argv, ["sh", "-c", "true"]);
            }
            other => panic!("{other:?}"),
        }
        let e = parse(&["status"]).unwrap_err();
        assert_eq!(e.code, EXIT_USAGE);
        assert_eq!(parse(&["bogus"]).unwrap_err().code, EXIT_USAGE);
        assert_eq!(
            parse(&["list", "--port=tcp:1"]).unwrap_err().code,
            EXIT_USAGE
        );
        assert_eq!(
            parse(&["--bus", "nope", "list"]).unwrap_err().code,
            EXIT_USAGE
        );
        assert!(
            parse(&["ensure", "a", "--metadata", "novalue"])
                .unwrap_err()
                .msg
                .contains("--metadata")
        );
    }

    #[test]
    fn dates() {
        assert_eq!(time_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(time_text(1_714_564_800), "2024-05-01 12:00:00 UTC");
    }
}
