//! The bench's arguments (see the usage text).

use std::path::{Path, PathBuf};

use crate::calls::Result;

#[derive(Debug)]
pub(crate) struct Args {
    pub(crate) agent: PathBuf,
    /// Another build (e.g. tests/upgrade/build-next.sh's) for the upgrade
    /// restart; none: that phase is skipped.
    pub(crate) next_agent: Option<PathBuf>,
    /// Another build whose pairs/s are measured in turns with this one's.
    pub(crate) baseline_agent: Option<PathBuf>,
    pub(crate) networks: usize,
    /// Networks of the last cold-ensure point (the scale check).
    pub(crate) networks_max: usize,
    pub(crate) samples: usize,
    pub(crate) bus_config: PathBuf,
    pub(crate) throughput_secs: f64,
    /// Keep the temp dir (agent logs) also after a successful run.
    pub(crate) keep: bool,
}

pub(crate) const USAGE: &str = "\
Usage: cube-netbench [--agent PATH] [--next-agent PATH] [--baseline-agent PATH] [--networks N] [--networks-max M] [--samples S] [--bus-config PATH] [--quick] [--keep]
  --agent PATH       agent binary [default: cube-network-agent next to this binary]
  --next-agent PATH  another build to upgrade to in place at N networks [default: none, phase skipped]
  --baseline-agent PATH  another build (an earlier release) whose ensure+release pairs/s are
                     measured in turns with this one's, 3 rounds each [default: none]
  --networks N       networks for the fill / restart phase [default: 10000]
  --networks-max M   networks of the last cold EnsureNetwork point [default: 3 x N]
  --samples S        latency samples per metric [default: 2000]
  --bus-config PATH  dbus-daemon config [default: tests/data/bus.conf]
  --quick            CI smoke run: N=300, S=200, 1 s throughput windows
  --keep             keep the temp dir (agent logs, state) and print its path
Must run as root.";

pub(crate) fn default_agent() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("cube-network-agent")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("target/release/cube-network-agent"))
}

pub(crate) fn default_bus_config() -> PathBuf {
    let rel = PathBuf::from("tests/data/bus.conf");
    if rel.exists() {
        rel
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bus.conf")
    }
}

pub(crate) fn parse_args() -> Result<Args> {
    let mut args = Args {
        agent: default_agent(),
        next_agent: None,
        baseline_agent: None,
        networks: 10_000,
        networks_max: 0,
        samples: 2_000,
        bus_config: default_bus_config(),
        throughput_secs: 3.0,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let number = |v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("'{v}' is not a number"))
        };
        match flag.as_str() {
            "--agent" => args.agent = value()?.into(),
            "--next-agent" => args.next_agent = Some(value()?.into()),
            "--baseline-agent" => args.baseline_agent = Some(value()?.into()),
            "--networks" => args.networks = number(value()?)?,
            "--networks-max" => args.networks_max = number(value()?)?,
            "--samples" => args.samples = number(value()?)?,
            "--bus-config" => args.bus_config = value()?.into(),
            "--quick" => {
                args.networks = 300;
                args.samples = 200;
                args.throughput_secs = 1.0;
            }
            "--keep" => args.keep = true,
            "-h" | "--help" => return Err(USAGE.into()),
            _ => return Err(format!("unknown argument '{flag}'\n{USAGE}")),
        }
    }
    if args.samples < 4 || args.networks == 0 {
        return Err("--samples must be >= 4 and --networks >= 1".into());
    }
    if args.networks_max == 0 {
        args.networks_max = args.networks * 3;
    }
    if args.networks_max < args.networks {
        return Err("--networks-max must be at least --networks".into());
    }
    Ok(args)
}
