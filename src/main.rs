//! `cube-network-agent`: parse configuration, recover, serve on D-Bus and
//! varlink, keep systemd informed.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use cube_network_agent::agent::Agent;
use cube_network_agent::config::{self, Command};
use cube_network_agent::dns::Passed;
use cube_network_agent::{dbus, error_chain, systemd, varlink};
use tracing::{error, info, warn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// journald when stderr is connected to it (`$JOURNAL_STREAM`), with every
/// event field as a journal field (`SANDBOX_ID=`, `TAP=`, ...); plain
/// readable stderr otherwise.
///
/// zbus opens an INFO span per incoming method call whose fields are the
/// whole message and header, formatted with `Debug` by the subscriber on
/// every call (~15 % of the agent's CPU under load, measured with perf).
/// Unless the filter names zbus itself, its spans and events are kept to
/// warnings.
fn init_logging(filter: &str) {
    let filter = effective_filter(filter);
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,zbus=warn"));
    if std::env::var_os("JOURNAL_STREAM").is_some()
        && let Ok(journald) = tracing_journald::layer()
    {
        tracing_subscriber::registry()
            .with(filter)
            .with(
                journald
                    .with_field_prefix(None)
                    .with_syslog_identifier("cube-network-agent".into()),
            )
            .init();
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

/// The operator's filter, with `zbus=warn` added unless it mentions zbus.
fn effective_filter(filter: &str) -> String {
    if filter.contains("zbus") {
        filter.to_owned()
    } else {
        format!("{filter},zbus=warn")
    }
}

fn main() -> ExitCode {
    let cfg = match config::parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(cfg)) => cfg,
        Ok(Command::PrintConfig(cfg)) => {
            // Checked exactly as a start would: a configuration the agent
            // would refuse is reported (exit 2) instead of printed.
            return match cfg.validate() {
                Ok(d) => {
                    print!("{}", toml::to_string(&*cfg).expect("config serialises"));
                    println!(
                        "# snat_port_range resolves to {}-{} here",
                        d.snat_ports.0, d.snat_ports.1
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!(
                        "cube-network-agent: invalid configuration: {}",
                        error_chain(&e)
                    );
                    ExitCode::from(2)
                }
            };
        }
        Ok(Command::Help) => {
            print!("{}", config::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("cube-network-agent {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("cube-network-agent: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    if let Err(e) = cfg.validate() {
        eprintln!(
            "cube-network-agent: invalid configuration: {}",
            error_chain(&e)
        );
        systemd::notify(&format!(
            "STATUS=invalid configuration: {}",
            error_chain(&e)
        ));
        return ExitCode::from(2);
    }
    // glibc gives each thread that allocates an arena of its own (up to 8
    // per core), each keeping what it freed; the agent's threads (tokio
    // workers, blocking pool, netlink, store writer) share two.
    // SAFETY: mallopt only changes allocator tunables; no thread exists yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    // One fd per TAP: take the whole open-file allowance the service
    // manager (LimitNOFILE=) or the shell granted, as systemd's own
    // services do; Health's fd_limits check says when it is too small.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one live rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    // Before any thread exists: the fds systemd passed (activation socket,
    // fd store content) and the environment that describes them.
    // SAFETY: no other thread exists yet (the runtime starts below).
    let passed = unsafe { systemd::take_listen_fds() };
    init_logging(&cfg.log_level);
    // Blocking kernel work (agent::off_worker) mostly waits for RTNL or the
    // datapath's lock, which admit one at a time: a few threads suffice, and
    // each extra one costs memory.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(8)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-network-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match rt.block_on(run(*cfg, passed)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = e, "exiting");
            systemd::notify(&format!("STATUS=failed: {e}"));
            ExitCode::FAILURE
        }
    };
    // STOPPING=1 and the last STATUS= may still wait for room in the
    // manager's queue.
    systemd::flush(std::time::Duration::from_secs(2));
    code
}

/// Splits what systemd passed: the varlink listening socket, TAP fds from
/// the fd store (named `tap-<ifindex>`), and the agent's own sockets for
/// sandboxes (`systemd::SOCKET_FD_NAMES`).
fn split_passed(passed: Vec<systemd::ListenFd>) -> (Option<UnixListener>, Vec<OwnedFd>, Passed) {
    let mut listener = None;
    let mut taps = vec![];
    let mut sockets = Passed::new();
    for p in passed {
        if p.name.starts_with("tap-") {
            taps.push(p.fd);
            continue;
        }
        if systemd::SOCKET_FD_NAMES.contains(&p.name.as_str()) {
            sockets.insert(p.name, p.fd);
            continue;
        }
        if listener.is_none() {
            match varlink::activation::listener_from(p.fd) {
                Ok(l) => listener = Some(l),
                Err(fd) => taps.push(fd),
            }
        } else {
            warn!(name = p.name, "ignoring an extra passed fd");
        }
    }
    (listener, taps, sockets)
}

fn status_line(agent: &Agent) -> String {
    format!(
        "{} networks, {} idle taps, {} free addresses",
        agent.active_networks(),
        agent.idle_taps(),
        agent.free_addresses()
    )
}

async fn run(cfg: config::Config, passed: Vec<systemd::ListenFd>) -> Result<(), String> {
    let bus = cfg.bus.clone();
    let (listener, taps, mut sockets) = split_passed(passed);
    if !taps.is_empty() {
        info!(fds = taps.len(), "TAP fds handed back by the fd store");
    }
    let agent = Agent::start(cfg, taps).await.map_err(|e| error_chain(&e))?;
    // The varlink socket first, then the bus name: once a client can see
    // the name, both front ends answer.
    varlink::serve(agent.clone(), listener).map_err(|e| error_chain(&e))?;
    varlink::report::serve(agent.clone());
    // The sandboxes' resolver (domain egress, docs/egress.md).
    let upstream = cube_network_agent::config::dns_upstream(agent.config());
    if let Err(e) = cube_network_agent::dns::serve(agent.clone(), upstream, &mut sockets) {
        warn!(
            error = %e,
            "dns: the resolver for sandboxes cannot listen on the gateway address, port 53; \
             sandboxes with domain rules resolve nothing"
        );
    }
    // The egress gateway (egress rules): the node CA, made at the first
    // start, and the roots upstreams are verified against.
    let gateway = egress_gateway(agent.config());
    agent.set_egress_gateway(match &gateway {
        Ok(g) => Ok(g.ca().cert_pem().to_owned()),
        Err(e) => {
            warn!(error = %e, "egress gateway: not running; sandboxes' egress rules intercept nothing");
            Err(e.clone())
        }
    });
    // Strict egress's proxy (egress_mode "sni") and egress rules.
    if let Err(e) =
        cube_network_agent::dns::proxy::serve(agent.clone(), upstream, gateway.ok(), &mut sockets)
    {
        warn!(
            error = %e,
            "proxy: strict egress cannot listen on the gateway address; \
             strict-mode sandboxes reach nothing on ports 80 and 443"
        );
    }
    let _conn = dbus::serve(agent.clone(), &bus)
        .await
        .map_err(|e| error_chain(&e))?;
    systemd::notify(&format!("READY=1\nSTATUS={}", status_line(&agent)));
    info!(
        networks = agent.active_networks(),
        idle_taps = agent.idle_taps(),
        free_addresses = agent.free_addresses(),
        "ready"
    );
    if systemd::under_service_manager() {
        tokio::spawn(keep_systemd_informed(agent.clone()));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    systemd::notify("STOPPING=1\nSTATUS=stopping; networks stay in place");
    agent.shutdown();
    Ok(())
}

/// STATUS= when it changes, and WATCHDOG=1 at half the watchdog interval
/// — but only while the agent core answers: the ping goes through the same
/// locks and runtime the calls use, so a wedged agent stops pinging and
/// systemd restarts it.
async fn keep_systemd_informed(agent: Arc<Agent>) {
    let watchdog = systemd::watchdog_interval();
    let tick = watchdog
        .map(|w| (w / 2).min(Duration::from_secs(2)))
        .unwrap_or(Duration::from_secs(2));
    let mut last = String::new();
    loop {
        tokio::time::sleep(tick).await;
        let status = status_line(&agent);
        let mut msg = String::new();
        if watchdog.is_some() && agent.alive().await {
            msg.push_str("WATCHDOG=1\n");
        }
        if status != last {
            msg.push_str(&format!("STATUS={status}\n"));
            last = status;
        }
        if !msg.is_empty() {
            systemd::notify(msg.trim_end());
        }
    }
}

/// The egress gateway: the node CA in the state directory and the
/// upstreams' roots (`egress_trust_bundle`, else the system store).
fn egress_gateway(
    cfg: &cube_network_agent::config::Config,
) -> Result<std::sync::Arc<cube_network_agent::dns::intercept::Interceptor>, String> {
    use cube_network_agent::dns::intercept::{Interceptor, NodeCa};
    let ca = NodeCa::load_or_create(&cfg.state_dir)?;
    let bundle = (!cfg.egress_trust_bundle.as_os_str().is_empty())
        .then_some(cfg.egress_trust_bundle.as_path());
    Interceptor::new(ca, bundle).map(std::sync::Arc::new)
}
