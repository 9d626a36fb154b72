//! `cube-network-agent`: parse configuration, recover, serve on D-Bus.

use std::process::ExitCode;
use std::sync::Arc;

use cube_network_agent::agent::Agent;
use cube_network_agent::config::{self, Command};
use cube_network_agent::datapath::NoopDatapath;
use cube_network_agent::{dbus, error_chain, systemd};
use tracing::{error, info};

fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn main() -> ExitCode {
    let cfg = match config::parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(cfg)) => cfg,
        Ok(Command::PrintConfig(cfg)) => {
            print!("{}", toml::to_string(&*cfg).expect("config serialises"));
            return ExitCode::SUCCESS;
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
        return ExitCode::from(2);
    }
    init_logging(&cfg.log_level);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-network-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(*cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = e, "exiting");
            systemd::notify(&format!("STATUS=failed: {e}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(cfg: config::Config) -> Result<(), String> {
    let bus = cfg.bus.clone();
    let agent = Agent::start(cfg, Arc::new(NoopDatapath))
        .await
        .map_err(|e| error_chain(&e))?;
    let _conn = dbus::serve(agent.clone(), &bus)
        .await
        .map_err(|e| error_chain(&e))?;
    let status = format!(
        "STATUS={} networks, {} idle taps, {} free addresses",
        agent.active_networks(),
        agent.idle_taps(),
        agent.free_addresses()
    );
    systemd::notify(&format!("READY=1\n{status}"));
    info!(
        networks = agent.active_networks(),
        idle_taps = agent.idle_taps(),
        free_addresses = agent.free_addresses(),
        "ready"
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    systemd::notify("STOPPING=1");
    agent.shutdown();
    Ok(())
}
