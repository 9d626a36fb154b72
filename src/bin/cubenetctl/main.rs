//! `cubenetctl`: the operator CLI for cube-network-agent, in the style of
//! `networkctl` / `busctl` / `systemctl`. It talks to `org.cube.NetworkAgent`
//! over D-Bus (and, for `watch` and `flows`, over its varlink socket) and nothing else;
//! every result it prints is what the agent said.
//!
//! Rooms: `args` (the command line), `help` (the command table and help
//! texts), `output` (tables, JSON, escaping), `json` (D-Bus values → the
//! one JSON shape of a network), `dbus` / `varlink` (the two wires),
//! `failure` (exit statuses), and one module per verb. The exit statuses are
//! a contract for scripts: see `help` and man/cubenetctl.1.

mod args;
mod capacity;
mod dbus;
mod egress;
mod ensure;
mod failure;
mod flows;
mod health;
mod help;
mod json;
mod list;
mod open_tap;
mod output;
mod reconcile;
mod release;
mod rules_file;
mod status;
mod top;
mod varlink;
mod watch;

use std::process::ExitCode;

use args::{Cmd, Environment, Global, Parsed, parse_args};
use failure::{EXIT_AGENT, Failure, Outcome, Res};

/// Prints the failure (every line `cubenetctl: ...`) and returns its code.
fn fail(f: Failure, ascii: bool) -> ExitCode {
    for line in f.lines() {
        eprintln!("{}", output::text(&line, ascii));
    }
    ExitCode::from(f.code)
}

async fn run(g: &Global, cmd: Cmd) -> Res<Outcome> {
    let agent = dbus::Agent::connect(&g.bus).await?;
    let out = &g.out;
    let code = match cmd {
        Cmd::List => list::run(&agent, out).await?,
        Cmd::Status(id) => status::run(&agent, out, &id).await?,
        Cmd::Ensure(id, o) => ensure::run(&agent, out, &id, &o).await?,
        Cmd::EgressRules(id, f) => egress::set_rules(&agent, out, &id, &f).await?,
        Cmd::EgressCa => egress::ca(&agent, out).await?,
        Cmd::Release(id) => release::run(&agent, out, &id).await?,
        Cmd::Reconcile(id) => reconcile::run(&agent, out, &id).await?,
        Cmd::Health => health::run(&agent, out).await?,
        Cmd::Capacity => capacity::run(&agent, out).await?,
        Cmd::OpenTap(ids, argv) => return open_tap::run(&agent, &ids, argv).await,
        Cmd::Watch | Cmd::Flows(_) | Cmd::Metrics(_) | Cmd::Top(_) => {
            unreachable!("watch, flows, metrics and top run without D-Bus")
        }
    };
    Ok(Outcome::Exit(code))
}

fn main() -> ExitCode {
    let env = Environment::from_process();
    let ascii = !env.utf8;
    let mut argv = vec![];
    for a in std::env::args_os().skip(1) {
        match a.into_string() {
            Ok(s) => argv.push(s),
            Err(a) => {
                let f = Failure::usage(format!("argument {a:?} is not UTF-8"));
                return fail(f, ascii);
            }
        }
    }
    let (global, cmd) = match parse_args(argv, &env) {
        Err(f) => return fail(f, ascii),
        Ok(Parsed::Help(None)) => {
            output::emit(&help::main_help());
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Help(Some(c))) => {
            output::emit(&help::command_help(c));
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            output::emit(&format!("cubenetctl {}\n", env!("CARGO_PKG_VERSION")));
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Run(g, c)) => (g, c),
    };
    if let Cmd::Top(o) = &cmd {
        return match top::run(o, &global.out) {
            Ok(code) => ExitCode::from(code),
            Err(f) => fail(f, ascii),
        };
    }
    if let Cmd::Metrics(path) = &cmd {
        return match varlink::openmetrics(path) {
            Ok(text) => {
                output::emit(&text);
                ExitCode::SUCCESS
            }
            Err(f) => fail(f, ascii),
        };
    }
    if let Cmd::Watch = cmd {
        return match watch::run(&global) {
            Ok(code) => ExitCode::from(code),
            Err(f) => fail(f, ascii),
        };
    }
    if let Cmd::Flows(o) = &cmd {
        return match flows::run(&global, o) {
            Ok(code) => ExitCode::from(code),
            Err(f) => fail(f, ascii),
        };
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let f = Failure::new(EXIT_AGENT, format!("starting the runtime: {e}"));
            return fail(f, ascii);
        }
    };
    let outcome = rt.block_on(run(&global, cmd));
    // Closes the bus connection before anything is exec'ed.
    drop(rt);
    match outcome {
        Ok(Outcome::Exit(code)) => ExitCode::from(code),
        Ok(Outcome::Exec(fds, argv)) => fail(open_tap::exec_with_taps(fds, &argv), ascii),
        Err(f) => fail(f, ascii),
    }
}
