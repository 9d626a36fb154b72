//! The command line → [`Parsed`]. Hand-written (the grammar is small and
//! every error names what the user typed), getopt-like: global options may
//! appear anywhere before `--`, short options bundle (`-qj`), options that
//! take a value accept `--opt=VALUE` and `--opt VALUE`, `--json` takes its
//! value only as `--json=MODE`.

use std::path::PathBuf;

use crate::failure::{Failure, Res};
use crate::help::{COMMANDS, CommandDef, find_command};
use crate::output::{JsonMode, Output};
use crate::rules_file::RulesFile;

/// Where the agent's varlink socket is unless `--varlink` or
/// `$CUBENETCTL_VARLINK` says otherwise (its `runtime_dir` default).
pub const DEFAULT_VARLINK: &str = "/run/cube-network-agent/org.cube.NetworkAgent";

/// The agent's metrics socket unless `$CUBENETCTL_REPORT` says otherwise
/// (its `report_socket` default).
pub const DEFAULT_REPORT: &str = "/run/systemd/report/org.cube.NetworkAgent";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bus {
    System,
    Session,
    Address(String),
}

impl Bus {
    pub fn describe(&self) -> String {
        match self {
            Bus::System => "system bus".into(),
            Bus::Session => "session bus".into(),
            Bus::Address(a) => format!("bus at {a}"),
        }
    }
}

/// What the process environment contributes to the options.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    /// `$CUBENETCTL_BUS`
    pub bus: Option<String>,
    /// `$CUBENETCTL_VARLINK`
    pub varlink: Option<String>,
    /// `$CUBENETCTL_REPORT`: the agent's metrics socket.
    pub report: Option<String>,
    /// `-j` means pretty on a terminal, short otherwise.
    pub stdout_is_tty: bool,
    /// The locale's character set is UTF-8 (else output is ASCII-only).
    pub utf8: bool,
}

impl Environment {
    pub fn from_process() -> Environment {
        use std::io::IsTerminal;
        let var = |k: &str| std::env::var(k).ok();
        Environment {
            bus: var("CUBENETCTL_BUS"),
            varlink: var("CUBENETCTL_VARLINK"),
            report: var("CUBENETCTL_REPORT"),
            stdout_is_tty: std::io::stdout().is_terminal(),
            utf8: crate::output::locale_is_utf8(var),
        }
    }
}

#[derive(Debug)]
pub struct Global {
    pub bus: Bus,
    pub varlink: PathBuf,
    pub out: Output,
}

/// One `--port` flag: what was typed (errors quote it) and its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortArg {
    pub typed: String,
    pub protocol: String,
    pub container_port: u16,
    pub host_port: u16,
    pub host_ip: String,
}

#[derive(Debug, Default)]
pub struct EnsureOpts {
    pub ports: Vec<PortArg>,
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    pub egress_mode: Option<String>,
    pub no_internet: bool,
    pub mtu: Option<u32>,
    /// Bandwidth limits as typed and as numbers (bits/s; bytes for bursts).
    pub rates: Vec<(&'static str, String, u64)>,
    pub metadata: Vec<(String, String)>,
    pub idempotency_key: Option<String>,
    pub clone_of: Option<String>,
    pub paused: bool,
    /// `--tap-owner UID[:GID]`: as typed, uid, gid.
    pub tap_owner: Option<(String, u32, Option<u32>)>,
    /// `--egress-rules FILE`: read and checked (its values are secrets:
    /// never formatted, Debug says `<secret>`).
    pub egress_rules: Option<RulesFile>,
}

#[derive(Debug)]
pub enum Cmd {
    List,
    Status(String),
    Ensure(String, Box<EnsureOpts>),
    /// `egress-rules ID FILE`: SetEgressRules.
    EgressRules(String, Box<RulesFile>),
    /// `egress-ca`: the node CA's certificate.
    EgressCa,
    Release(String),
    Reconcile(String),
    Health,
    Capacity,
    /// The networks (their TAPs go on fds 3, 4, ... in this order) and
    /// the command.
    OpenTap(Vec<String>, Vec<String>),
    Watch,
    /// `flows`: the flow log (WatchFlows).
    Flows(crate::flows::FlowsOpts),
    /// The metrics socket to read.
    Metrics(PathBuf),
    Top(TopOpts),
}

/// `top`: the metrics socket, how often, how many tables (None: until
/// interrupted).
#[derive(Debug)]
pub struct TopOpts {
    pub report: PathBuf,
    pub interval: std::time::Duration,
    pub count: Option<u32>,
}

/// The options of `top` (accepted only after the command name).
pub const TOP_FLAGS: &[&str] = &["--interval", "--count"];

#[derive(Debug)]
pub enum Parsed {
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
    egress_mode: Option<String>,
    no_internet: bool,
    mtu: Option<String>,
    /// (option key, flag, value) of --egress-rate and the like.
    rates: Vec<(&'static str, &'static str, String)>,
    metadata: Vec<String>,
    idempotency_key: Option<String>,
    clone_of: Option<String>,
    paused: bool,
    tap_owner: Option<String>,
    egress_rules: Option<String>,
}

/// The options of `ensure` (accepted only after the command name).
pub const ENSURE_FLAGS: &[&str] = &[
    "--port",
    "--allow-out",
    "--deny-out",
    "--egress-mode",
    "--egress-rate",
    "--ingress-rate",
    "--egress-burst",
    "--ingress-burst",
    "--no-internet",
    "--mtu",
    "--metadata",
    "--idempotency-key",
    "--clone-of",
    "--paused",
    "--tap-owner",
    "--egress-rules",
];

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
            "--json={o}: expected pretty, short or off"
        ))),
    }
}

/// A port number in `min..=65535`, with the agent's wording for the range.
fn port_number(what: &str, s: &str, min: u16) -> Result<u16, String> {
    if s.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{what} '{s}' is not a number"));
    }
    match s.parse::<u16>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("{what} {s} is out of range ({min}-65535)")),
    }
}

/// `PROTO:CONTAINER[:HOST[:HOSTIP]]`: the container port 1-65535, the host
/// port 0-65535 (0 or empty: the agent picks one).
pub fn parse_port(s: &str) -> Result<PortArg, String> {
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
    let container_port = port_number("container port", container, 1).map_err(fail)?;
    let host_port = match parts.next() {
        None | Some("") => 0,
        Some(h) => port_number("host port", h, 0).map_err(fail)?,
    };
    let ip = parts.next().unwrap_or_default();
    if !ip.is_empty() && ip.parse::<std::net::IpAddr>().is_err() {
        return Err(fail(format!("host IP '{ip}' is not an IP address")));
    }
    Ok(PortArg {
        typed: s.to_owned(),
        protocol: proto,
        container_port,
        host_port,
        host_ip: ip.to_owned(),
    })
}

/// `UID[:GID]`, numbers only (the agent never looks names up: the VMM's
/// uid is what the kernel compares).
fn parse_tap_owner(s: &str) -> Result<(String, u32, Option<u32>), String> {
    let num = |part: &str, what: &str| {
        part.parse::<u32>().map_err(|_| {
            format!(
                "--tap-owner {s}: {what} '{part}' is not a number (usage: --tap-owner UID[:GID])"
            )
        })
    };
    let (uid, gid) = match s.split_once(':') {
        Some((u, g)) => (num(u, "uid")?, Some(num(g, "gid")?)),
        None => (num(s, "uid")?, None),
    };
    Ok((s.to_owned(), uid, gid))
}

fn build_ensure(raw: RawEnsure) -> Res<EnsureOpts> {
    let mut o = EnsureOpts {
        allow_out: raw.allow_out,
        deny_out: raw.deny_out,
        egress_mode: raw.egress_mode,
        no_internet: raw.no_internet,
        idempotency_key: raw.idempotency_key,
        clone_of: raw.clone_of,
        paused: raw.paused,
        ..EnsureOpts::default()
    };
    if let Some(t) = raw.tap_owner {
        o.tap_owner = Some(parse_tap_owner(&t).map_err(Failure::usage)?);
    }
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
    for (key, flag, v) in raw.rates {
        let n = if key.ends_with("_bps") {
            cube_network_agent::types::parse_rate(&v)
        } else {
            cube_network_agent::types::parse_size(&v)
        }
        .map_err(|why| Failure::usage(format!("{flag} {v}: {why}")))?;
        o.rates.retain(|(k, _, _)| *k != key);
        o.rates.push((key, format!("{flag} {v}"), n));
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
    // Last: the other flags' mistakes come first, and stdin (`-`) is read
    // only for a command line that is otherwise fine.
    if let Some(path) = raw.egress_rules {
        o.egress_rules = Some(crate::rules_file::read(&path)?);
    }
    Ok(o)
}

/// Short options, which may be bundled (`-qj`); `-f` is `flows`' own.
const SHORT: &str = "hjqVf";

pub fn parse_args(args: Vec<String>, env: &Environment) -> Res<Parsed> {
    // `open-tap A B -- COMMAND`: with `--`, every id comes before it.
    let dashdash = args.iter().any(|a| a == "--");
    let mut it = args.into_iter();
    let mut command: Option<&'static CommandDef> = None;
    let mut positional: Vec<String> = vec![];
    let mut trailing: Option<Vec<String>> = None;
    let mut help = false;
    let mut version = false;
    let mut json = JsonMode::Off;
    let mut legend = true;
    let mut quiet = false;
    let mut bus: Option<Bus> = None;
    let mut varlink: Option<String> = None;
    let mut raw = RawEnsure::default();
    let (mut interval, mut count): (Option<String>, Option<String>) = (None, None);
    // `flows`: --denied, --follow, --since as typed.
    let (mut denied, mut follow, mut since) = (false, false, None::<String>);
    let auto_json = if env.stdout_is_tty {
        JsonMode::Pretty
    } else {
        JsonMode::Short
    };

    while let Some(arg) = it.next() {
        if arg == "--" {
            trailing = Some(it.by_ref().collect());
            break;
        }
        if let Some(shorts) = arg.strip_prefix('-')
            && !shorts.is_empty()
            && !shorts.starts_with('-')
        {
            if !shorts.chars().all(|c| SHORT.contains(c)) {
                return Err(Failure::usage(format!("unknown option '{arg}'")));
            }
            for c in shorts.chars() {
                match c {
                    'h' => help = true,
                    'j' => json = auto_json,
                    'q' => quiet = true,
                    'f' if command.is_some_and(|c| c.name == "flows") => follow = true,
                    'f' => {
                        return Err(Failure::usage(
                            "-f is an option of 'flows' (after the command: cubenetctl flows -f)",
                        ));
                    }
                    _ => version = true,
                }
            }
            continue;
        }
        if arg.len() > 2 && arg.starts_with("--") {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
                None => (arg.clone(), None),
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
            let is_top = command.is_some_and(|c| c.name == "top");
            let is_flows = command.is_some_and(|c| c.name == "flows");
            match flag.as_str() {
                "--help" => {
                    no_value(&inline)?;
                    help = true;
                }
                "--version" => {
                    no_value(&inline)?;
                    version = true;
                }
                "--json" => json = parse_json_mode(inline.as_deref())?,
                "--quiet" => {
                    no_value(&inline)?;
                    quiet = true;
                }
                "--no-legend" => {
                    no_value(&inline)?;
                    legend = false;
                }
                // Nothing to turn off: cubenetctl never pages.
                "--no-pager" => no_value(&inline)?,
                "--bus" => bus = Some(parse_bus(&value(inline)?, "--bus")?),
                "--varlink" => {
                    let v = value(inline)?;
                    if v.is_empty() {
                        return Err(Failure::usage("--varlink needs a socket path"));
                    }
                    varlink = Some(v);
                }
                "--port" if is_ensure => raw.ports.push(value(inline)?),
                "--allow-out" if is_ensure => raw.allow_out.push(value(inline)?),
                "--deny-out" if is_ensure => raw.deny_out.push(value(inline)?),
                "--egress-mode" if is_ensure => raw.egress_mode = Some(value(inline)?),
                "--egress-rate" if is_ensure => {
                    raw.rates
                        .push(("egress_bps", "--egress-rate", value(inline)?))
                }
                "--ingress-rate" if is_ensure => {
                    raw.rates
                        .push(("ingress_bps", "--ingress-rate", value(inline)?))
                }
                "--egress-burst" if is_ensure => {
                    raw.rates
                        .push(("egress_burst", "--egress-burst", value(inline)?))
                }
                "--ingress-burst" if is_ensure => {
                    raw.rates
                        .push(("ingress_burst", "--ingress-burst", value(inline)?))
                }
                "--no-internet" if is_ensure => {
                    no_value(&inline)?;
                    raw.no_internet = true;
                }
                "--mtu" if is_ensure => raw.mtu = Some(value(inline)?),
                "--metadata" if is_ensure => raw.metadata.push(value(inline)?),
                "--idempotency-key" if is_ensure => raw.idempotency_key = Some(value(inline)?),
                "--clone-of" if is_ensure => raw.clone_of = Some(value(inline)?),
                "--paused" if is_ensure => {
                    no_value(&inline)?;
                    raw.paused = true;
                }
                "--tap-owner" if is_ensure => raw.tap_owner = Some(value(inline)?),
                "--egress-rules" if is_ensure => {
                    let v = value(inline)?;
                    if v.is_empty() {
                        return Err(Failure::usage(
                            "--egress-rules needs a file (a JSON array of rules; - for stdin)",
                        ));
                    }
                    raw.egress_rules = Some(v);
                }
                "--denied" if is_flows => {
                    no_value(&inline)?;
                    denied = true;
                }
                "--follow" if is_flows => {
                    no_value(&inline)?;
                    follow = true;
                }
                "--since" if is_flows => since = Some(value(inline)?),
                f if crate::flows::FLAGS.contains(&f) => {
                    return Err(Failure::usage(format!(
                        "{flag} is an option of 'flows' (after the command: cubenetctl flows {flag})"
                    )));
                }
                "--interval" if is_top => interval = Some(value(inline)?),
                "--count" if is_top => count = Some(value(inline)?),
                f if TOP_FLAGS.contains(&f) => {
                    return Err(Failure::usage(format!(
                        "{flag} is an option of 'top' (after the command: cubenetctl top {flag}=N)"
                    )));
                }
                f if ENSURE_FLAGS.contains(&f) => {
                    return Err(Failure::usage(format!(
                        "{flag} is an option of 'ensure' (after the command: cubenetctl ensure ID {flag} ...)"
                    )));
                }
                _ => return Err(Failure::usage(format!("unknown option '{flag}'"))),
            }
            continue;
        }
        match command {
            // `cubenetctl help [COMMAND]`: the same as --help.
            None if arg == "help" && !help => {
                help = true;
            }
            None => {
                command = Some(
                    find_command(&arg)
                        .ok_or_else(|| Failure::usage(format!("unknown command '{arg}'")))?,
                );
            }
            Some(c) if c.name == "open-tap" && positional.len() == 1 && !dashdash => {
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
    let bus = match (bus, &env.bus) {
        (Some(b), _) => b,
        (None, Some(e)) if !e.is_empty() => parse_bus(e, "$CUBENETCTL_BUS")?,
        _ => Bus::System,
    };
    let varlink = varlink
        .or_else(|| env.varlink.clone().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| DEFAULT_VARLINK.to_owned())
        .into();
    let global = Global {
        bus,
        varlink,
        out: Output {
            json,
            legend,
            quiet,
            ascii: !env.utf8,
        },
    };
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
        "capacity" => {
            want(0)?;
            Cmd::Capacity
        }
        "watch" => {
            want(0)?;
            Cmd::Watch
        }
        "flows" => {
            if positional.len() > 1 {
                want(1)?;
            }
            let since = since
                .as_deref()
                .map(crate::flows::parse_since)
                .transpose()
                .map_err(Failure::usage)?;
            Cmd::Flows(crate::flows::FlowsOpts {
                sandbox_id: positional.pop(),
                denied,
                follow,
                since,
            })
        }
        "metrics" => {
            want(0)?;
            Cmd::Metrics(PathBuf::from(
                env.report
                    .clone()
                    .unwrap_or_else(|| DEFAULT_REPORT.to_owned()),
            ))
        }
        "top" => {
            want(0)?;
            if json != JsonMode::Off {
                return Err(Failure::usage(
                    "'top' is a live view without JSON output: use 'cubenetctl status --json' \
                     or 'cubenetctl metrics' for machine-readable traffic",
                ));
            }
            let secs: f64 = match interval.as_deref() {
                None => 2.0,
                Some(v) => v
                    .parse()
                    .ok()
                    .filter(|s: &f64| (0.1..=3600.0).contains(s))
                    .ok_or_else(|| {
                        Failure::usage(format!(
                            "--interval '{v}': expected seconds between 0.1 and 3600"
                        ))
                    })?,
            };
            let count = match count.as_deref() {
                None => None,
                Some(v) => Some(v.parse().ok().filter(|n: &u32| *n >= 1).ok_or_else(|| {
                    Failure::usage(format!(
                        "--count '{v}': expected a number of tables, 1 or more"
                    ))
                })?),
            };
            Cmd::Top(TopOpts {
                report: PathBuf::from(
                    env.report
                        .clone()
                        .unwrap_or_else(|| DEFAULT_REPORT.to_owned()),
                ),
                interval: std::time::Duration::from_secs_f64(secs),
                count,
            })
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
            Cmd::Ensure(positional.remove(0), Box::new(build_ensure(raw)?))
        }
        "egress-rules" => {
            if positional.len() == 1 {
                return Err(Failure::usage(
                    "'egress-rules' needs FILE, a JSON array of rules; - for stdin \
                     (usage: cubenetctl egress-rules ID FILE)",
                ));
            }
            want(2)?;
            let file = crate::rules_file::read(&positional[1])?;
            Cmd::EgressRules(positional.remove(0), Box::new(file))
        }
        "egress-ca" => {
            want(0)?;
            Cmd::EgressCa
        }
        "open-tap" => {
            if positional.is_empty() {
                want(1)?;
            }
            let argv = trailing.unwrap_or_default();
            if argv.is_empty() {
                return Err(Failure::usage(
                    "'open-tap' needs a command to run (usage: cubenetctl open-tap ID... -- COMMAND [ARGS...])",
                ));
            }
            Cmd::OpenTap(std::mem::take(&mut positional), argv)
        }
        other => unreachable!("command table entry {other} not handled"),
    };
    Ok(Parsed::Run(global, cmd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::EXIT_USAGE;

    fn parse_env(args: &[&str], env: &Environment) -> Res<Parsed> {
        parse_args(args.iter().map(|s| s.to_string()).collect(), env)
    }

    fn parse(args: &[&str]) -> Res<Parsed> {
        parse_env(args, &Environment::default())
    }

    fn global(args: &[&str], env: &Environment) -> Global {
        match parse_env(args, env) {
            Ok(Parsed::Run(g, _)) => g,
            other => panic!("{other:?}"),
        }
    }

    /// Every option of `ensure` is in the man page and both completions
    /// (one list is the truth: ENSURE_FLAGS).
    #[test]
    fn ensure_options_agree_with_the_man_page_and_completions() {
        let man = include_str!("../../../man/cubenetctl.1").replace("\\-", "-");
        let bash = include_str!("../../../completions/cubenetctl.bash");
        let zsh = include_str!("../../../completions/_cubenetctl");
        for f in ENSURE_FLAGS {
            assert!(man.contains(f), "{f} missing from man/cubenetctl.1");
            assert!(
                bash.contains(f),
                "{f} missing from completions/cubenetctl.bash"
            );
            assert!(zsh.contains(f), "{f} missing from completions/_cubenetctl");
        }
    }

    #[test]
    fn flows_options() {
        let flows = |args: &[&str]| match parse(args) {
            Ok(Parsed::Run(_, Cmd::Flows(o))) => o,
            other => panic!("{args:?}: {other:?}"),
        };
        assert_eq!(flows(&["flows"]), crate::flows::FlowsOpts::default());
        let o = flows(&["flows", "sbx-1", "--denied", "-f", "--since=10m", "--json"]);
        assert_eq!(
            o,
            crate::flows::FlowsOpts {
                sandbox_id: Some("sbx-1".into()),
                denied: true,
                follow: true,
                since: Some(600),
            }
        );
        assert!(flows(&["flows", "-qf"]).follow);
        assert_eq!(
            flows(&["flows", "--follow", "--since", "30"]).since,
            Some(30)
        );
        let e = parse(&["flows", "--since", "2h"]).unwrap_err();
        assert_eq!(e.code, EXIT_USAGE);
        assert!(e.msg.starts_with("--since 2h: more than 1h"), "{}", e.msg);
        assert_eq!(parse(&["flows", "a", "b"]).unwrap_err().code, EXIT_USAGE);
        assert!(
            parse(&["-f", "flows"])
                .unwrap_err()
                .msg
                .contains("option of 'flows'")
        );
        assert!(
            parse(&["list", "--denied"])
                .unwrap_err()
                .msg
                .contains("option of 'flows'")
        );
        assert!(
            parse(&["flows", "--follow=1"])
                .unwrap_err()
                .msg
                .contains("takes no value")
        );
    }

    #[test]
    fn help_as_a_command_and_top_without_json() {
        assert!(matches!(parse(&["help"]).unwrap(), Parsed::Help(None)));
        assert!(matches!(
            parse(&["help", "ensure"]).unwrap(),
            Parsed::Help(Some(c)) if c.name == "ensure"
        ));
        let e = parse(&["top", "--json"]).unwrap_err();
        assert!(format!("{e:?}").contains("without JSON output"), "{e:?}");
    }

    #[test]
    fn ports_parse_with_specific_errors() {
        let p = parse_port("tcp:80").unwrap();
        assert_eq!(
            (p.protocol.as_str(), p.container_port, p.host_port),
            ("tcp", 80, 0)
        );
        assert_eq!(p.typed, "tcp:80");
        let p = parse_port("UDP:53:25053:127.0.0.1").unwrap();
        assert_eq!(
            (
                p.protocol.as_str(),
                p.container_port,
                p.host_port,
                p.host_ip.as_str()
            ),
            ("udp", 53, 25053, "127.0.0.1")
        );
        assert_eq!(parse_port("tcp:80::10.0.0.1").unwrap().host_port, 0);
        assert_eq!(parse_port("tcp:1:65535").unwrap().host_port, 65535);
        let e = parse_port("tcp:80:x").unwrap_err();
        assert_eq!(e, "--port tcp:80:x: host port 'x' is not a number");
        assert_eq!(
            parse_port("tcp:70000").unwrap_err(),
            "--port tcp:70000: container port 70000 is out of range (1-65535)"
        );
        assert_eq!(
            parse_port("tcp:0").unwrap_err(),
            "--port tcp:0: container port 0 is out of range (1-65535)"
        );
        assert_eq!(
            parse_port("tcp:80:65536").unwrap_err(),
            "--port tcp:80:65536: host port 65536 is out of range (0-65535)"
        );
        assert!(
            parse_port("tcp:99999999999999999999")
                .unwrap_err()
                .contains("out of range (1-65535)")
        );
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
            parse_port("tcp:80:1:nope")
                .unwrap_err()
                .contains("host IP 'nope'")
        );
    }

    #[test]
    fn parses_commands_and_global_options_anywhere() {
        match parse(&["ensure", "a", "--json", "--port=tcp:80", "--mtu", "1400"]).unwrap() {
            Parsed::Run(g, Cmd::Ensure(id, o)) => {
                assert_eq!(g.out.json, JsonMode::Short);
                assert_eq!(id, "a");
                assert_eq!(o.ports.len(), 1);
                assert_eq!(o.mtu, Some(1400));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(&[]).unwrap(), Parsed::Run(_, Cmd::List)));
        assert!(matches!(
            parse(&["watch", "--no-pager"]).unwrap(),
            Parsed::Run(_, Cmd::Watch)
        ));
        assert!(matches!(
            parse(&["ensure", "--help", "--port", "bad"]).unwrap(),
            Parsed::Help(Some(c)) if c.name == "ensure"
        ));
        assert!(matches!(parse(&["-V"]).unwrap(), Parsed::Version));
        assert!(matches!(parse(&["-qV"]).unwrap(), Parsed::Version));
        match parse(&["open-tap", "x", "--", "sh", "-c", "true"]).unwrap() {
            Parsed::Run(_, Cmd::OpenTap(ids, argv)) => {
                assert_eq!(ids, ["x"]);
                assert_eq!(argv, ["sh", "-c", "true"]);
            }
            other => panic!("{other:?}"),
        }
        // Several networks (fds 3, 4, ...) before `--`; without `--` the
        // first word after the id starts the command, as before.
        match parse(&["open-tap", "a", "b", "--", "vmm", "--x"]).unwrap() {
            Parsed::Run(_, Cmd::OpenTap(ids, argv)) => {
                assert_eq!(ids, ["a", "b"]);
                assert_eq!(argv, ["vmm", "--x"]);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["open-tap", "a", "vmm", "b"]).unwrap() {
            Parsed::Run(_, Cmd::OpenTap(ids, argv)) => {
                assert_eq!(ids, ["a"]);
                assert_eq!(argv, ["vmm", "b"]);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["ensure", "x", "--tap-owner", "1000:27"]).unwrap() {
            Parsed::Run(_, Cmd::Ensure(_, o)) => {
                assert_eq!(o.tap_owner, Some(("1000:27".into(), 1000, Some(27))));
            }
            other => panic!("{other:?}"),
        }
        match parse(&["ensure", "x", "--tap-owner=0"]).unwrap() {
            Parsed::Run(_, Cmd::Ensure(_, o)) => {
                assert_eq!(o.tap_owner, Some(("0".into(), 0, None)))
            }
            other => panic!("{other:?}"),
        }
        for bad in ["kvm", "1000:", ":5", "-1", "1:2:3"] {
            let e = parse(&["ensure", "x", "--tap-owner", bad]).unwrap_err();
            assert_eq!(e.code, EXIT_USAGE);
            assert!(e.msg.contains("--tap-owner"), "{bad}: {}", e.msg);
        }
        let e = parse(&["status"]).unwrap_err();
        assert_eq!(e.code, EXIT_USAGE);
        assert_eq!(parse(&["bogus"]).unwrap_err().code, EXIT_USAGE);
        assert_eq!(parse(&["watch", "x"]).unwrap_err().code, EXIT_USAGE);
        assert_eq!(
            parse(&["list", "--port=tcp:1"]).unwrap_err().code,
            EXIT_USAGE
        );
        assert_eq!(
            parse(&["--bus", "nope", "list"]).unwrap_err().code,
            EXIT_USAGE
        );
        assert!(
            parse(&["-x"])
                .unwrap_err()
                .msg
                .contains("unknown option '-x'")
        );
        assert!(
            parse(&["ensure", "-bad-id"])
                .unwrap_err()
                .msg
                .contains("unknown option '-bad-id'")
        );
        assert!(
            parse(&["--json=long"])
                .unwrap_err()
                .msg
                .contains("expected pretty, short or off")
        );
        assert!(
            parse(&["ensure", "a", "--metadata", "novalue"])
                .unwrap_err()
                .msg
                .contains("--metadata")
        );
    }

    #[test]
    fn output_options() {
        let tty = Environment {
            stdout_is_tty: true,
            utf8: true,
            ..Environment::default()
        };
        let pipe = Environment::default();
        assert_eq!(global(&["-j"], &tty).out.json, JsonMode::Pretty);
        assert_eq!(global(&["-j"], &pipe).out.json, JsonMode::Short);
        assert_eq!(global(&["--json=pretty"], &pipe).out.json, JsonMode::Pretty);
        assert_eq!(global(&["-j", "--json=off"], &tty).out.json, JsonMode::Off);
        assert_eq!(global(&[], &tty).out.json, JsonMode::Off);
        let g = global(&["-qj", "--no-legend"], &pipe);
        assert!(g.out.quiet && !g.out.legend);
        assert_eq!(g.out.json, JsonMode::Short);
        assert!(global(&["--quiet"], &pipe).out.quiet);
        assert!(!global(&[], &tty).out.ascii);
        assert!(global(&[], &pipe).out.ascii);
    }

    #[test]
    fn bus_and_varlink_from_flags_or_environment() {
        let env = Environment {
            bus: Some("session".into()),
            varlink: Some("/tmp/agent.sock".into()),
            ..Environment::default()
        };
        let g = global(&[], &env);
        assert_eq!(g.bus, Bus::Session);
        assert_eq!(g.varlink, PathBuf::from("/tmp/agent.sock"));
        let g = global(&["--bus=system", "--varlink", "/x"], &env);
        assert_eq!(g.bus, Bus::System);
        assert_eq!(g.varlink, PathBuf::from("/x"));
        let g = global(&[], &Environment::default());
        assert_eq!(g.bus, Bus::System);
        assert_eq!(g.varlink, PathBuf::from(DEFAULT_VARLINK));
        assert_eq!(parse(&["--varlink="]).unwrap_err().code, EXIT_USAGE);
    }
}
