//! `cube-netbench`: measures the agent against SPEC §10 in a throw-away
//! environment (private network namespaces, private dbus-daemon, temp state)
//! and prints one table with the raw floors measured in the same run.
//!
//! Usage: `cube-netbench [--agent PATH] [--networks N] [--samples S]
//! [--bus-config PATH] [--quick] [--keep]`. Needs root (network namespaces, TAPs).
//! Timing never fails a run: a missed SPEC §10 target is marked "(MISSED)"
//! in the table and reported with its own exit code.
//!
//! Exit codes (`.ci/run` fails on 1, 2 and 130 and only notes 3):
//!
//! | code | meaning |
//! |------|---------|
//! | 0    | ran; every SPEC §10 target in the table met |
//! | 1    | broken: the agent did not start / reach READY=1 / exit when signalled, a call failed, timed out (30 s) or answered wrongly, or a measurement could not be taken (partial table, logs kept) |
//! | 2    | setup failed: bad arguments, not root, no tokio runtime, the temp dir or private dbus-daemon could not be set up |
//! | 3    | ran, every call answered, but a performance target was missed (informational) |
//! | 130  | interrupted (Ctrl-C) |

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod floor;

use cube_network_agent::dbus::{BUS_NAME, MANAGER_PATH};
use cube_network_agent::tap::Tap;
use zbus::Connection;
use zbus::zvariant::{OwnedFd, OwnedValue};

const IFACE: &str = "org.cube.NetworkAgent";
/// Clones of one source per clone row.
const CLONES: usize = 100;
/// Recovery of 10k networks can be slow; a run waits this long for READY=1.
const READY_TIMEOUT: Duration = Duration::from_secs(600);
/// A call slower than this counts as a failure (the agent is wedged).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a signalled agent may take to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(900);
/// The SIGTERM restart is measured too only when exiting is this quick.
const QUICK_EXIT: Duration = Duration::from_secs(10);
const CONCURRENT_CALLERS: usize = 16;

type Error = String;
type Result<T> = std::result::Result<T, Error>;

/// Why a run failed: decides the exit code (see the table at the top).
enum Failure {
    /// Exit 1: the agent or a call failed.
    Broken(String),
    /// Exit 2: the environment could not be set up.
    Setup(String),
    /// Exit 130: Ctrl-C.
    Interrupted,
}

const EXIT_BROKEN: u8 = 1;
const EXIT_SETUP: u8 = 2;
const EXIT_TARGET_MISSED: u8 = 3;
const EXIT_INTERRUPTED: u8 = 130;

// ---------------------------------------------------------------- arguments

#[derive(Debug)]
struct Args {
    agent: PathBuf,
    /// Another build (e.g. tests/upgrade/build-next.sh's) for the upgrade
    /// restart; none: that phase is skipped.
    next_agent: Option<PathBuf>,
    /// Another build whose pairs/s are measured in turns with this one's.
    baseline_agent: Option<PathBuf>,
    networks: usize,
    /// Networks of the last cold-ensure point (the scale check).
    networks_max: usize,
    samples: usize,
    bus_config: PathBuf,
    throughput_secs: f64,
    /// Keep the temp dir (agent logs) also after a successful run.
    keep: bool,
}

const USAGE: &str = "\
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

fn default_agent() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("cube-network-agent")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("target/release/cube-network-agent"))
}

fn default_bus_config() -> PathBuf {
    let rel = PathBuf::from("tests/data/bus.conf");
    if rel.exists() {
        rel
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bus.conf")
    }
}

fn parse_args() -> Result<Args> {
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

// -------------------------------------------------------------- environment

/// One running agent: `ip netns exec NS AGENT ...`. `ip netns exec` execs
/// the agent, so the child's pid is the agent's pid.
struct AgentProc {
    child: Child,
    log: PathBuf,
}

impl AgentProc {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Owns everything the bench creates; `Drop` removes all of it.
struct Env {
    pid: u32,
    tmp: PathBuf,
    netns: Vec<String>,
    bus: Option<Child>,
    bus_addr: String,
    agent: Option<AgentProc>,
    agent_bin: PathBuf,
    notify_path: PathBuf,
    /// READY=1 messages seen so far. A thread drains the notify socket all
    /// the time, as a service manager does: the agent pushes every TAP fd
    /// to the fd store (FDSTORE=1), and an undrained socket would make
    /// those sends wait.
    ready_count: Arc<AtomicU64>,
    ready_seen: u64,
    /// bpffs mounts to remove at the end.
    mounts: Vec<PathBuf>,
    runs: usize,
    /// Set on failure: the temp dir (with the agent logs) is left in place.
    keep_tmp: bool,
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().map_err(|e| format!("running {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Asks the kernel to SIGKILL the child when the bench dies, so a crashed
/// bench leaves no agent or bus behind.
fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs between fork and exec and only calls prctl,
    // which is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

impl Env {
    async fn new(args: &Args) -> Result<Env> {
        let pid = std::process::id();
        let tmp = std::env::temp_dir().join(format!("cnb-{pid}"));
        fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
        let notify_path = tmp.join("notify.sock");
        let notify = std::os::unix::net::UnixDatagram::bind(&notify_path)
            .map_err(|e| format!("binding {}: {e}", notify_path.display()))?;
        let ready_count = Arc::new(AtomicU64::new(0));
        let counter = ready_count.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = notify.recv(&mut buf) {
                if String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == "READY=1")
                {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let mut env = Env {
            pid,
            tmp,
            netns: vec![],
            bus: None,
            bus_addr: String::new(),
            agent: None,
            agent_bin: args.agent.clone(),
            notify_path,
            ready_count,
            ready_seen: 0,
            mounts: vec![],
            runs: 0,
            keep_tmp: false,
        };
        env.start_bus(&args.bus_config)?;
        Ok(env)
    }

    fn start_bus(&mut self, config: &Path) -> Result<()> {
        if !config.exists() {
            return Err(format!(
                "bus config {} not found (use --bus-config)",
                config.display()
            ));
        }
        let sock = self.tmp.join("bus.sock");
        let mut child = die_with_parent(
            Command::new("dbus-daemon")
                .arg(format!("--config-file={}", config.display()))
                .arg(format!("--address=unix:path={}", sock.display()))
                .args(["--nofork", "--nopidfile", "--print-address"])
                .stdout(Stdio::piped())
                .stderr(File::create(self.tmp.join("bus.log")).map_err(|e| e.to_string())?),
        )
        .spawn()
        .map_err(|e| format!("starting dbus-daemon: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        self.bus = Some(child);
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| format!("reading the bus address: {e}"))?;
        if line.trim().is_empty() {
            return Err("dbus-daemon exited without printing its address".into());
        }
        self.bus_addr = line.trim().to_owned();
        Ok(())
    }

    async fn connect(&self) -> Result<Connection> {
        zbus::connection::Builder::address(self.bus_addr.as_str())
            .map_err(|e| format!("bus address {}: {e}", self.bus_addr))?
            .method_timeout(CALL_TIMEOUT)
            .build()
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.bus_addr))
    }

    /// A fresh namespace + state dir for a new agent instance.
    fn new_instance(&mut self) -> Result<(String, PathBuf)> {
        self.runs += 1;
        let ns = format!("cnb-{}-{}", self.pid, self.runs);
        run_cmd(Command::new("ip").args(["netns", "add", &ns]))?;
        self.netns.push(ns.clone());
        let dir = self.tmp.join(format!("agent{}", self.runs));
        fs::create_dir_all(dir.join("state")).map_err(|e| e.to_string())?;
        fs::create_dir_all(dir.join("run")).map_err(|e| e.to_string())?;
        // Each instance pins its eBPF maps in a bpffs of its own (`ip netns
        // exec` remounts /sys, so /sys/fs/bpf is no bpffs inside it).
        let bpf = dir.join("bpf");
        fs::create_dir_all(&bpf).map_err(|e| e.to_string())?;
        run_cmd(Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&bpf))?;
        self.mounts.push(bpf.clone());
        fs::write(
            dir.join("config.toml"),
            format!("bpf_pin_dir = \"{}\"\n", bpf.display()),
        )
        .map_err(|e| e.to_string())?;
        Ok((ns, dir))
    }

    /// Spawns the agent and returns the time from spawn to READY=1.
    async fn start_agent(
        &mut self,
        ns: &str,
        dir: &Path,
        warm_pool: usize,
        networks: usize,
    ) -> Result<Duration> {
        assert!(self.agent.is_none(), "one agent at a time");
        self.drain_notify();
        let log = dir.join(format!("agent-{}.log", self.runs_of(dir)));
        let log_file = File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(&self.agent_bin)
            .arg("--config")
            .arg(dir.join("config.toml"))
            .args(["--bus", &self.bus_addr])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--runtime-dir")
            .arg(dir.join("run"))
            .args(["--warm-pool", &warm_pool.to_string()])
            .args(
                self.agent_has_report_socket()
                    .then(|| {
                        [
                            "--report-socket".into(),
                            dir.join("report.sock").into_os_string(),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .env("NOTIFY_SOCKET", &self.notify_path)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file);
        if networks > 16_000 {
            cmd.args(["--pool-cidr", "10.96.0.0/14"]);
        }
        let start = Instant::now();
        let child = die_with_parent(&mut cmd)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.agent_bin.display()))?;
        self.agent = Some(AgentProc { child, log });
        self.wait_ready().await?;
        Ok(start.elapsed())
    }

    fn runs_of(&self, dir: &Path) -> usize {
        fs::read_dir(dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Remembers how many READY=1 were seen, so `wait_ready` waits for the
    /// next one.
    fn drain_notify(&mut self) {
        self.ready_seen = self.ready_count.load(Ordering::SeqCst);
    }

    /// Waits for READY=1 on the notify socket while watching the child.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if self.ready_count.load(Ordering::SeqCst) > self.ready_seen {
                self.ready_seen = self.ready_count.load(Ordering::SeqCst);
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            let agent = self.agent.as_mut().expect("agent running");
            if let Ok(Some(status)) = agent.child.try_wait() {
                let log = agent.log.display().to_string();
                self.agent = None;
                return Err(format!(
                    "agent exited ({status}) before READY=1; log: {log}"
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "agent not READY after {READY_TIMEOUT:?}; log: {}",
                    self.log_path()
                ));
            }
        }
    }

    fn log_path(&self) -> String {
        self.agent
            .as_ref()
            .map_or_else(|| "(no agent)".into(), |a| a.log.display().to_string())
    }

    fn agent_pid(&self) -> Result<u32> {
        self.agent
            .as_ref()
            .map(AgentProc::pid)
            .ok_or_else(|| "no agent running".into())
    }

    /// Sends `sig` and waits for the agent to exit; returns how long it took.
    /// The kernel detaches every TAP fd on exit (one RCU grace period
    /// each), so an agent holding 10k TAPs may take minutes to die.
    async fn stop_agent(&mut self, sig: nix::sys::signal::Signal) -> Result<Duration> {
        let Some(mut agent) = self.agent.take() else {
            return Ok(Duration::ZERO);
        };
        let pid = nix::unistd::Pid::from_raw(agent.pid() as i32);
        let start = Instant::now();
        nix::sys::signal::kill(pid, sig).map_err(|e| format!("kill {pid} {sig}: {e}"))?;
        loop {
            match agent.child.try_wait() {
                Ok(Some(_)) => return Ok(start.elapsed()),
                Ok(None) if start.elapsed() > EXIT_TIMEOUT => {
                    let _ = agent.child.kill();
                    return Err(format!(
                        "agent still running {EXIT_TIMEOUT:?} after {sig}; log: {}",
                        agent.log.display()
                    ));
                }
                Ok(None) => tokio::time::sleep(Duration::from_micros(500)).await,
                Err(e) => return Err(format!("waiting for the agent: {e}")),
            }
        }
    }

    /// Whether the agent under test knows `--report-socket` (builds before
    /// the metrics socket do not).
    fn agent_has_report_socket(&self) -> bool {
        Command::new(&self.agent_bin)
            .arg("--help")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--report-socket"))
    }

    /// The agent's CPU time so far (every thread, from schedstat: ns).
    fn agent_cpu(&self) -> Result<Duration> {
        process_cpu(self.agent_pid()?)
    }

    fn agent_rss_kb(&self) -> Result<u64> {
        let pid = self.agent_pid()?;
        let status =
            fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| "no VmRSS in /proc/PID/status".into())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // No wait for the agent: with many TAPs the kernel needs minutes to
        // tear its fds down; init reaps it. Deleting the namespace below
        // still removes every TAP once that is done.
        if let Some(mut a) = self.agent.take() {
            let _ = a.child.kill();
        }
        if let Some(mut bus) = self.bus.take() {
            let _ = bus.kill();
            let _ = bus.wait();
        }
        // Deleting the namespace deletes all its TAPs in one go.
        for ns in self.netns.drain(..) {
            let _ = Command::new("ip")
                .args(["netns", "del", &ns])
                .stderr(Stdio::null())
                .status();
        }
        for m in self.mounts.drain(..) {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
        if !self.keep_tmp {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

// ------------------------------------------------------------------ calls

fn empty_options() -> HashMap<String, OwnedValue> {
    HashMap::new()
}

/// One Capacity call (what a scheduler polls).
async fn capacity(conn: &Connection) -> Result<()> {
    conn.call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "Capacity", &())
        .await
        .map(drop)
        .map_err(|e| format!("Capacity: {e}"))
}

async fn ping(conn: &Connection) -> Result<()> {
    conn.call_method(
        Some(BUS_NAME),
        MANAGER_PATH,
        Some("org.freedesktop.DBus.Peer"),
        "Ping",
        &(),
    )
    .await
    .map(drop)
    .map_err(|e| format!("Ping: {e}"))
}

/// Who answers EnsureNetwork/ReleaseNetwork: the agent, or the bus floor
/// server (see [`floor`]).
#[derive(Clone, Copy)]
struct Target<'a> {
    dest: &'a str,
    path: &'a str,
    iface: &'a str,
}

const AGENT: Target<'static> = Target {
    dest: BUS_NAME,
    path: MANAGER_PATH,
    iface: IFACE,
};

async fn ensure(conn: &Connection, id: &str) -> Result<()> {
    ensure_at(conn, AGENT, id).await
}

async fn release(conn: &Connection, id: &str) -> Result<()> {
    release_at(conn, AGENT, id).await
}

async fn ensure_at(conn: &Connection, t: Target<'_>, id: &str) -> Result<()> {
    ensure_with(conn, t, id, empty_options()).await
}

/// EnsureNetwork(id, options) as a VMM launcher calls it.
async fn ensure_with(
    conn: &Connection,
    t: Target<'_>,
    id: &str,
    options: HashMap<String, OwnedValue>,
) -> Result<()> {
    conn.call_method(
        Some(t.dest),
        t.path,
        Some(t.iface),
        "EnsureNetwork",
        &(id, options),
    )
    .await
    .map_err(|e| format!("EnsureNetwork({id}): {e}"))?
    .body()
    .deserialize::<HashMap<String, OwnedValue>>()
    .map(drop)
    .map_err(|e| format!("EnsureNetwork({id}) reply: {e}"))
}

async fn release_at(conn: &Connection, t: Target<'_>, id: &str) -> Result<()> {
    let released: bool = conn
        .call_method(
            Some(t.dest),
            t.path,
            Some(t.iface),
            "ReleaseNetwork",
            &(id,),
        )
        .await
        .map_err(|e| format!("ReleaseNetwork({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("ReleaseNetwork({id}) reply: {e}"))?;
    if released {
        Ok(())
    } else {
        Err(format!("ReleaseNetwork({id}) returned false"))
    }
}

async fn open_tap(conn: &Connection, id: &str) -> Result<()> {
    conn.call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "OpenTap", &(id,))
        .await
        .map_err(|e| format!("OpenTap({id}): {e}"))?
        .body()
        .deserialize::<OwnedFd>()
        .map(drop)
        .map_err(|e| format!("OpenTap({id}) reply: {e}"))
}

async fn timed<F: Future<Output = Result<()>>>(f: F) -> Result<Duration> {
    let t = Instant::now();
    f.await?;
    Ok(t.elapsed())
}

// ------------------------------------------------------------------ stats

/// Sorted latency samples.
struct Lat(Vec<Duration>);

impl Lat {
    fn new(mut v: Vec<Duration>) -> Lat {
        v.sort();
        Lat(v)
    }
    fn pct(&self, p: usize) -> f64 {
        let i = (self.0.len() * p / 100).min(self.0.len() - 1);
        self.0[i].as_secs_f64() * 1e6
    }
    fn p50(&self) -> f64 {
        self.pct(50)
    }
    fn p99(&self) -> f64 {
        self.pct(99)
    }
    fn max(&self) -> f64 {
        self.pct(100)
    }
    fn show(&self) -> String {
        format!("{:.0} / {:.0} µs", self.p50(), self.p99())
    }
}

// ------------------------------------------------------------------ floors

async fn floor_ping(conn: &Connection, samples: usize) -> Result<Lat> {
    for _ in 0..50 {
        ping(conn).await?;
    }
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        v.push(timed(ping(conn)).await?);
    }
    Ok(Lat::new(v))
}

async fn floor_open_tap(conn: &Connection, samples: usize) -> Result<Lat> {
    ensure(conn, "bench-fd-0").await?;
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        v.push(timed(open_tap(conn, "bench-fd-0")).await?);
    }
    release(conn, "bench-fd-0").await?;
    Ok(Lat::new(v))
}

/// Ping calls/s with `callers` concurrent tasks on one connection.
async fn ping_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, _, _| async move {
        ping(&conn).await
    })
    .await
}

/// Operations per second over `secs`: `callers` tasks on one connection each
/// run `op(conn, caller, iteration)` in a loop until the deadline.
async fn rate<F, Fut>(conn: &Connection, callers: usize, secs: f64, op: F) -> Result<f64>
where
    F: Fn(Connection, usize, usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let op = &op;
    per_second(callers, secs, |c, deadline| {
        let conn = conn.clone();
        async move {
            let mut n = 0usize;
            while Instant::now() < deadline {
                op(conn.clone(), c, n).await?;
                n += 1;
            }
            Ok(n)
        }
    })
    .await
}

/// Operations per second of `callers` tasks, each `task(caller, deadline)`
/// returning how many it did before the deadline.
async fn per_second<T, Fut>(callers: usize, secs: f64, task: T) -> Result<f64>
where
    T: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = Result<usize>>,
{
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let total: usize = futures::future::try_join_all((0..callers).map(|c| task(c, deadline)))
        .await?
        .into_iter()
        .sum();
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// write tmp, fsync, rename, fsync dir — what one durable record costs.
fn floor_durable_write(dir: &Path, samples: usize) -> Result<Lat> {
    let data = [0x5au8; 1024];
    let d = File::open(dir).map_err(|e| e.to_string())?;
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        let tmp = dir.join(format!("rec-{i}.tmp"));
        let dst = dir.join(format!("rec-{}", i % 16));
        let t = Instant::now();
        let mut f = File::create(&tmp).map_err(|e| e.to_string())?;
        f.write_all(&data).map_err(|e| e.to_string())?;
        f.sync_all().map_err(|e| e.to_string())?;
        fs::rename(&tmp, &dst).map_err(|e| e.to_string())?;
        d.sync_all().map_err(|e| e.to_string())?;
        v.push(t.elapsed());
    }
    Ok(Lat::new(v))
}

/// 1 KB append + fdatasync to one journal file — what the agent's store
/// pays per commit (SPEC: "append + fdatasync journal").
fn floor_journal_append(dir: &Path, samples: usize) -> Result<Lat> {
    let data = [0xa5u8; 1024];
    let mut f = File::create(dir.join("journal")).map_err(|e| e.to_string())?;
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        f.write_all(&data).map_err(|e| e.to_string())?;
        f.sync_data().map_err(|e| e.to_string())?;
        v.push(t.elapsed());
    }
    Ok(Lat::new(v))
}

/// TUNSETIFF in a private namespace owned by a dedicated thread; the
/// namespace (and its TAPs) goes away when the thread exits.
fn floor_tap_create(samples: usize) -> Result<Lat> {
    std::thread::spawn(move || {
        // SAFETY: unshare only changes this thread's namespace membership
        // (CLONE_NEWNET is per thread); no memory is involved.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut taps = Vec::with_capacity(samples);
        let mut v = Vec::with_capacity(samples);
        for i in 0..samples {
            let name = format!("cnbt{i}");
            let t = Instant::now();
            let tap = Tap::create(&name).map_err(|e| cube_network_agent::error_chain(&e))?;
            v.push(t.elapsed());
            taps.push(tap);
        }
        Ok(Lat::new(v))
    })
    .join()
    .map_err(|_| "TAP floor thread panicked".to_string())?
}

// ------------------------------------------------------------------ agent phases

struct Warm {
    ensure: Lat,
    release: Lat,
}

async fn warm_ensure_release(conn: &Connection, samples: usize) -> Result<Warm> {
    let (mut e, mut r) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for i in 0..samples {
        let id = format!("bench-warm-{i}");
        e.push(timed(ensure(conn, &id)).await?);
        r.push(timed(release(conn, &id)).await?);
    }
    Ok(Warm {
        ensure: Lat::new(e),
        release: Lat::new(r),
    })
}

/// Clones of one source (two port mappings, egress rules): `n` made one
/// after another (each released before the next, as the warm rows),
/// alternating with the same spec given explicitly, then
/// `n` kept at once made by `callers` tasks next to `n` networks given the
/// same spec, made the same way (the warm pool runs dry in both);
/// released untimed.
struct Clones {
    serial: Lat,
    explicit: Lat,
    burst: Lat,
    explicit_burst: Lat,
    /// Each kept clone: from OpenTap's reply to the datapath's answer to
    /// its first frame; and the same for the source, a network made long
    /// before (the reference).
    first_answer: Lat,
    source_first_answer: Lat,
}

/// The node's guest identity, from GetNetwork: (guest MAC, guest IP,
/// gateway IP), what a restored guest's frames carry.
async fn guest_identity(conn: &Connection, id: &str) -> Result<([u8; 6], [u8; 4], [u8; 4])> {
    let net: HashMap<String, OwnedValue> = conn
        .call_method(
            Some(BUS_NAME),
            MANAGER_PATH,
            Some(IFACE),
            "GetNetwork",
            &(id,),
        )
        .await
        .map_err(|e| format!("GetNetwork({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("GetNetwork({id}) reply: {e}"))?;
    let field = |k: &str| -> Result<String> {
        net.get(k)
            .and_then(|v| String::try_from(v.try_clone().ok()?).ok())
            .ok_or_else(|| format!("GetNetwork({id}): no {k}"))
    };
    let mac: Vec<u8> = field("guest_mac")?
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).map_err(|e| e.to_string()))
        .collect::<Result<_>>()?;
    let ip = |k: &str| -> Result<[u8; 4]> {
        // guest_ip comes with its prefix length ("169.254.68.6/30").
        Ok(field(k)?
            .split('/')
            .next()
            .unwrap_or_default()
            .parse::<std::net::Ipv4Addr>()
            .map_err(|e| e.to_string())?
            .octets())
    };
    Ok((
        mac.try_into().map_err(|_| "guest_mac: not 6 bytes")?,
        ip("guest_ip")?,
        ip("gateway_ip")?,
    ))
}

/// What a VMM restoring a snapshot does first: OpenTap, then the guest's
/// first frame. An ARP request for the gateway is written every 5 ms
/// until the datapath's proxy ARP answers it (`from_guest` runs for the
/// TAP with the sandbox's entry): the time from OpenTap's reply to the
/// answer.
async fn first_answer(
    conn: &Connection,
    id: &str,
    who: ([u8; 6], [u8; 4], [u8; 4]),
) -> Result<Duration> {
    let fd: OwnedFd = conn
        .call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "OpenTap", &(id,))
        .await
        .map_err(|e| format!("OpenTap({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("OpenTap({id}) reply: {e}"))?;
    let fd = std::os::fd::OwnedFd::from(fd);
    let t = Instant::now();
    let id = id.to_owned();
    tokio::task::spawn_blocking(move || {
        arp_until_answered(&fd, who, t, Duration::from_secs(5))
            .map_err(|e| format!("{id}: the first frame after OpenTap: {e}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

fn arp_until_answered(
    fd: &std::os::fd::OwnedFd,
    (mac, guest_ip, gateway_ip): ([u8; 6], [u8; 4], [u8; 4]),
    t: Instant,
    limit: Duration,
) -> Result<Duration> {
    use std::os::fd::AsRawFd;
    // The agent's TAPs carry a 12-byte virtio-net header (zero: no offload).
    const VNET: usize = 12;
    let mut req = vec![0u8; VNET];
    req.extend_from_slice(&[0xff; 6]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&guest_ip);
    req.extend_from_slice(&[0; 6]);
    req.extend_from_slice(&gateway_ip);
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl(2) on an fd this function borrows; only its flags change.
    unsafe {
        let fl = libc::fcntl(raw, libc::F_GETFL);
        libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let mut buf = vec![0u8; VNET + 65550];
    while t.elapsed() < limit {
        // SAFETY: `req` is a live buffer of `req.len()` bytes; write(2) only reads it.
        unsafe { libc::write(raw, req.as_ptr().cast(), req.len()) };
        let mut pfd = libc::pollfd {
            fd: raw,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 5) };
        loop {
            // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
            let n = unsafe { libc::read(raw, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= VNET as isize {
                break;
            }
            let f = &buf[VNET..n as usize];
            if f.len() >= 42
                && f[12..14] == [8, 6]
                && f[20..22] == [0, 2]
                && f[28..32] == gateway_ip
            {
                return Ok(t.elapsed());
            }
        }
    }
    Err(format!("no proxy-ARP answer within {limit:?}"))
}

/// `None`: the agent under test predates `clone_of` (an older build as
/// `--agent`), so there are no clone rows.
async fn clone_phase(conn: &Connection, n: usize, callers: usize) -> Result<Option<Clones>> {
    let owned = |v: zbus::zvariant::Value<'_>| -> Result<OwnedValue> {
        OwnedValue::try_from(v).map_err(|e| e.to_string())
    };
    let source_opts = || -> Result<HashMap<String, OwnedValue>> {
        Ok(HashMap::from([
            (
                "port_mappings".to_string(),
                owned(zbus::zvariant::Value::from(vec![
                    ("tcp", 80u16, 0u16, ""),
                    ("udp", 53u16, 0u16, ""),
                ]))?,
            ),
            (
                "allow_out".to_string(),
                owned(zbus::zvariant::Value::from(vec![
                    "10.1.0.0/16",
                    "example.com",
                ]))?,
            ),
        ]))
    };
    ensure_with(conn, AGENT, "bench-clone-src", source_opts()?).await?;
    let clone_opts = || -> Result<HashMap<String, OwnedValue>> {
        Ok(HashMap::from([(
            "clone_of".to_string(),
            owned(zbus::zvariant::Value::from("bench-clone-src"))?,
        )]))
    };
    // As the warm rows, each released (untimed) before the next, so the
    // warm pool never runs dry; alternating with the same spec given
    // explicitly, so the difference is clone_of's own.
    let (mut serial, mut explicit) = (Vec::with_capacity(n), Vec::with_capacity(n));
    if let Err(e) = ensure_with(conn, AGENT, "bench-clone-probe", clone_opts()?).await {
        release(conn, "bench-clone-src").await?;
        return if e.contains("unknown option 'clone_of'") {
            Ok(None)
        } else {
            Err(e)
        };
    }
    release(conn, "bench-clone-probe").await?;
    for i in 0..n {
        let id = format!("bench-clone-s{i}");
        serial.push(timed(ensure_with(conn, AGENT, &id, clone_opts()?)).await?);
        release(conn, &id).await?;
        let id = format!("bench-explicit-s{i}");
        explicit.push(timed(ensure_with(conn, AGENT, &id, source_opts()?)).await?);
        release(conn, &id).await?;
    }
    // `callers` tasks share the n calls.
    async fn burst(
        conn: &Connection,
        n: usize,
        callers: usize,
        prefix: &str,
        opts: &(dyn Fn() -> Result<HashMap<String, OwnedValue>> + Sync),
    ) -> Result<Lat> {
        let next = AtomicUsize::new(0);
        let per: Vec<Vec<Duration>> = futures::future::try_join_all((0..callers).map(|_| async {
            let mut v = vec![];
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, String>(v);
                }
                let id = format!("{prefix}{i}");
                v.push(timed(ensure_with(conn, AGENT, &id, opts()?)).await?);
            }
        }))
        .await?;
        Ok(Lat::new(per.into_iter().flatten().collect()))
    }
    async fn release_all(conn: &Connection, n: usize, prefix: &str) -> Result<()> {
        for i in 0..n {
            release(conn, &format!("{prefix}{i}")).await?;
        }
        Ok(())
    }
    let burst_clones = burst(conn, n, callers, "bench-clone-b", &clone_opts).await?;
    // The kept clones' first frames, all restored at once (as many tasks
    // as callers); then the source's, one at a time, as the reference.
    let who = guest_identity(conn, "bench-clone-src").await?;
    let next = AtomicUsize::new(0);
    let firsts: Vec<Vec<Duration>> = futures::future::try_join_all((0..callers).map(|_| async {
        let mut v = vec![];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                return Ok::<_, String>(v);
            }
            v.push(first_answer(conn, &format!("bench-clone-b{i}"), who).await?);
        }
    }))
    .await?;
    let mut source_firsts = Vec::with_capacity(10);
    for _ in 0..10 {
        source_firsts.push(first_answer(conn, "bench-clone-src", who).await?);
    }
    release_all(conn, n, "bench-clone-b").await?;
    let explicit_burst = burst(conn, n, callers, "bench-explicit-b", &source_opts).await?;
    release_all(conn, n, "bench-explicit-b").await?;
    release(conn, "bench-clone-src").await?;
    Ok(Some(Clones {
        serial: Lat::new(serial),
        explicit: Lat::new(explicit),
        burst: burst_clones,
        explicit_burst,
        first_answer: Lat::new(firsts.into_iter().flatten().collect()),
        source_first_answer: Lat::new(source_firsts),
    }))
}

/// Times only the ensure; releases each network untimed so the count stays flat.
async fn cold_ensures(conn: &Connection, phase: &str, samples: usize) -> Result<Lat> {
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        let id = format!("bench-{phase}-{i}");
        v.push(timed(ensure(conn, &id)).await?);
        release(conn, &id).await?;
    }
    Ok(Lat::new(v))
}

/// Ensure+release pairs per second over `secs` with `callers` tasks.
async fn pair_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, c, n| async move {
        let id = format!("bench-tput{callers}-{c}-{n}");
        ensure(&conn, &id).await?;
        release(&conn, &id).await
    })
    .await
}

/// Ensure, OpenTap (the fd closed at once), Release: what a VMM does.
async fn vmm_pair_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, c, n| async move {
        let id = format!("bench-vmm{callers}-{c}-{n}");
        ensure(&conn, &id).await?;
        open_tap(&conn, &id).await?;
        release(&conn, &id).await
    })
    .await
}

/// One varlink call on `stream`: the reply's `parameters`, or its error.
async fn varlink_call_on(
    stream: &mut tokio::net::UnixStream,
    method: &str,
    parameters: serde_json::Value,
) -> Result<serde_json::Value> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut msg =
        serde_json::to_vec(&serde_json::json!({ "method": method, "parameters": parameters }))
            .map_err(|e| e.to_string())?;
    msg.push(0);
    stream
        .write_all(&msg)
        .await
        .map_err(|e| format!("{method}: {e}"))?;
    let mut reply = vec![];
    let mut r = tokio::io::BufReader::new(&mut *stream);
    r.read_until(0, &mut reply)
        .await
        .map_err(|e| format!("{method}: {e}"))?;
    reply.pop();
    let v: serde_json::Value =
        serde_json::from_slice(&reply).map_err(|e| format!("{method} reply: {e}"))?;
    if let Some(e) = v.get("error") {
        return Err(format!("{method}: {e} {}", v["parameters"]));
    }
    Ok(v["parameters"].clone())
}

/// Ensure+release pairs/s over varlink, a connection per caller.
async fn varlink_pair_rate(path: &Path, callers: usize, secs: f64) -> Result<f64> {
    per_second(callers, secs, |c, deadline| async move {
        let mut stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|e| format!("varlink {}: {e}", path.display()))?;
        let mut n = 0usize;
        while Instant::now() < deadline {
            let id = format!("bench-vl{callers}-{c}-{n}");
            varlink_call_on(
                &mut stream,
                "org.cube.NetworkAgent.EnsureNetwork",
                serde_json::json!({ "sandbox_id": id }),
            )
            .await?;
            varlink_call_on(
                &mut stream,
                "org.cube.NetworkAgent.ReleaseNetwork",
                serde_json::json!({ "sandbox_id": id }),
            )
            .await?;
            n += 1;
        }
        Ok(n)
    })
    .await
}

/// Pairs/s of this build and of `base`, each on a fresh instance, in
/// turns (3 rounds), so drift on a shared machine hits both alike.
async fn baseline_rows(
    env: &mut Env,
    conn: &Connection,
    base: &Path,
    n: usize,
    secs: f64,
    rows: &mut Vec<Row>,
) -> Result<()> {
    eprintln!(
        "[5b/10] ensure+release pairs/s, this build and {} in turns",
        base.display()
    );
    let this = env.agent_bin.clone();
    let (mut mine, mut theirs) = (vec![], vec![]);
    let (mut mine_cpu, mut theirs_cpu) = (vec![], vec![]);
    for round in 0..3 {
        for (bin, out, cpu) in [
            (&this, &mut mine, &mut mine_cpu),
            (&base.to_path_buf(), &mut theirs, &mut theirs_cpu),
        ] {
            env.agent_bin = bin.clone();
            let (ns, dir) = env.new_instance()?;
            env.start_agent(&ns, &dir, 64, n).await?;
            for i in 0..20 {
                let id = format!("bench-base-warm-{round}-{i}");
                ensure(conn, &id).await?;
                release(conn, &id).await?;
            }
            let cost = costed(
                env.agent_pid()?,
                secs,
                pair_rate(conn, CONCURRENT_CALLERS, secs),
            )
            .await?;
            out.push(cost.rate);
            cpu.push(cost.cpu_per_pair_us);
            env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        }
    }
    env.agent_bin = this;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (m, t) = (median(&mut mine), median(&mut theirs));
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    rows.push(
        row(
            format!("pairs/s, {CONCURRENT_CALLERS} callers: this build vs --baseline-agent (median of 3)"),
            format!("{m:.0}/s ({})", show(&mine)),
            format!("baseline {t:.0}/s ({})", show(&theirs)),
            format!("{:.2}x", m / t.max(1.0)),
            ">= 0.9x",
        )
        .met(m >= 0.9 * t),
    );
    let (mc, tc) = (median(&mut mine_cpu), median(&mut theirs_cpu));
    rows.push(row(
        format!(
            "agent CPU per pair, {CONCURRENT_CALLERS} callers: this build vs --baseline-agent (median of 3)"
        ),
        format!("{mc:.0} µs ({})", show(&mine_cpu)),
        format!("baseline {tc:.0} µs ({})", show(&theirs_cpu)),
        format!("{:.2}x", mc / tc.max(1.0)),
        "-",
    ));
    Ok(())
}

/// The bus floor server (see [`floor`]), killed on drop.
struct FloorProc {
    child: Child,
    name: String,
}

/// A process's CPU time so far: every thread's on-CPU time from
/// schedstat, kernel work done in its system calls included (ns).
fn process_cpu(pid: u32) -> Result<Duration> {
    let mut ns = 0u64;
    for t in fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| e.to_string())? {
        let t = t.map_err(|e| e.to_string())?;
        if let Ok(s) = fs::read_to_string(t.path().join("schedstat")) {
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(Duration::from_nanos(ns))
}

/// The machine's busy and total CPU time so far (/proc/stat, in ticks).
fn machine_cpu() -> (u64, u64) {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next() else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle and iowait.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// What a pair-rate window cost: the server's CPU per pair (µs) and how
/// busy the machine was (0..1).
struct PairCost {
    rate: f64,
    cpu_per_pair_us: f64,
    busy: f64,
}

async fn costed<F: std::future::Future<Output = Result<f64>>>(
    pid: u32,
    secs: f64,
    window: F,
) -> Result<PairCost> {
    let (c0, m0) = (process_cpu(pid)?, machine_cpu());
    let rate = window.await?;
    let (c1, m1) = (process_cpu(pid)?, machine_cpu());
    let pairs = (rate * secs).max(1.0);
    Ok(PairCost {
        rate,
        cpu_per_pair_us: (c1 - c0).as_secs_f64() * 1e6 / pairs,
        busy: (m1.0 - m0.0) as f64 / (m1.1 - m0.1).max(1) as f64,
    })
}

impl FloorProc {
    /// The bus floor; with `kernel_ns`, the kernel floor in that namespace.
    fn start(env: &Env, kernel_ns: Option<&str>) -> Result<FloorProc> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut cmd = match kernel_ns {
            None => Command::new(&exe),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
        };
        cmd.args(["--serve-floor", &env.bus_addr]);
        if kernel_ns.is_some() {
            cmd.arg("--kernel");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the floor server: {e}"))?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("floor server: no stdout")?;
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| format!("floor server: {e}"))?;
        let name = line.trim().to_owned();
        if !name.starts_with(':') {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("floor server did not start (said '{name}')"));
        }
        Ok(FloorProc { child, name })
    }

    /// Ensure+release pairs/s against the floor server.
    async fn pair_rate(&self, conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
        let target = Target {
            dest: self.name.as_str(),
            path: floor::PATH,
            iface: floor::IFACE,
        };
        rate(conn, callers, secs, |conn, c, n| async move {
            let id = format!("bench-floor{callers}-{c}-{n}");
            ensure_at(&conn, target, &id).await?;
            release_at(&conn, target, &id).await
        })
        .await
    }
}

impl Drop for FloorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Counts the agent's signals on a connection of its own (a match rule
/// for every signal the agent's name sends), in the background.
struct SignalCounter {
    count: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
    _conn: Connection,
}

impl SignalCounter {
    async fn start(env: &Env) -> Result<SignalCounter> {
        use futures::StreamExt;
        let conn = env.connect().await?;
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .sender(BUS_NAME)
            .map_err(|e| format!("match rule: {e}"))?
            .build();
        let mut stream = zbus::MessageStream::for_match_rule(rule, &conn, Some(65_536))
            .await
            .map_err(|e| format!("AddMatch: {e}"))?;
        let count = Arc::new(AtomicU64::new(0));
        let c = count.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(_)) = stream.next().await {
                c.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(SignalCounter {
            count,
            task,
            _conn: conn,
        })
    }

    /// Stops counting once the signals of the last calls had time to
    /// arrive; the total.
    async fn stop(self) -> u64 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        self.task.abort();
        self.count.load(Ordering::Relaxed)
    }
}

/// Ensures `n` networks with concurrent callers; returns the wall time.
/// This process's (and so the agents') RLIMIT_NOFILE.
fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one live rlimit struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}

/// Creates `n` persistent TAPs (not the agent's: another prefix) whose
/// clsact qdiscs are bound to the agent's blocks, as a network's are; the
/// namespace's deletion removes them.
fn bound_taps(n: usize) -> Result<()> {
    use cube_network_agent::datapath::tc;
    let block = cube_network_agent::config::Config::default().tc_block;
    for i in 0..n {
        let name = format!("cnbx{i:06}");
        drop(Tap::create(&name).map_err(|e| format!("creating {name}: {e}"))?);
        let index =
            nix::net::if_::if_nametoindex(name.as_str()).map_err(|e| format!("{name}: {e}"))?;
        tc::add_clsact(index, Some(block)).map_err(|e| format!("binding {name}: {e}"))?;
    }
    Ok(())
}

/// Raises this process's (and so the agents') RLIMIT_NOFILE to `want`,
/// hard limit included (root may), if it is lower.
fn raise_nofile(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one live rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < want {
            lim.rlim_cur = want;
            lim.rlim_max = lim.rlim_max.max(want);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                // No CAP_SYS_RESOURCE: up to the hard limit then.
                let _ = libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    }
}

/// Ensures networks `from..to` with 16 callers.
async fn fill(conn: &Connection, from: usize, n: usize) -> Result<Duration> {
    let next = Arc::new(AtomicUsize::new(from));
    let start = Instant::now();
    let tasks = (0..CONCURRENT_CALLERS).map(|_| {
        let (conn, next) = (conn.clone(), next.clone());
        async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<(), Error>(());
                }
                ensure(&conn, &format!("bench-fill-{i}")).await?;
            }
        }
    });
    futures::future::try_join_all(tasks).await?;
    Ok(start.elapsed())
}

/// Release cost and pair throughput at one size of the flow map.
struct FlowPoint {
    flows: usize,
    release: Lat,
    pairs: f64,
}

/// Fills the agent's pinned `ct` map with synthetic flows (0, 10k, 100k)
/// and measures ReleaseNetwork and ensure+release pairs/s at each size.
/// The flows belong to a few live sandboxes (their generation read from
/// `by_ip`): the reaper drops flows of addresses nobody owns. None when the
/// agent runs without the eBPF datapath.
async fn flow_load(
    conn: &Connection,
    pins: &Path,
    samples: usize,
    secs: f64,
) -> Result<Option<Vec<FlowPoint>>> {
    use aya::maps::{HashMap as BpfMap, Map, MapData};
    use cube_network_agent::datapath::maps::{DP_CT_SNAT, DpCtKey, DpCtVal, DpTap};
    if !pins.join("ct").exists() {
        return Ok(None);
    }
    for i in 0..16 {
        ensure(conn, &format!("bench-flow-owner-{i}")).await?;
    }
    let open = |name: &str| {
        MapData::from_pin(pins.join(name)).map_err(|e| format!("opening the pinned {name}: {e}"))
    };
    let by_ip: BpfMap<MapData, u32, DpTap> =
        BpfMap::try_from(Map::HashMap(open("by_ip")?)).map_err(|e| e.to_string())?;
    let owners: Vec<(u32, u64)> = by_ip
        .iter()
        .flatten()
        .map(|(ip, t)| (ip, t.generation))
        .collect();
    if owners.is_empty() {
        return Err("no sandbox in the pinned by_ip map".into());
    }
    let mut ct: BpfMap<MapData, DpCtKey, DpCtVal> =
        BpfMap::try_from(Map::LruHashMap(open("ct")?)).map_err(|e| e.to_string())?;
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .map_err(|e| e.to_string())?;
    let mut points = vec![];
    let mut filled = 0usize;
    for flows in [0usize, 10_000, 100_000] {
        while filled < flows {
            let i = filled as u32;
            let (sandbox_ip, generation) = owners[filled % owners.len()];
            // 100.64.0.0/10 remotes, one per flow: no key repeats.
            let remote = 0x6440_0000u32 + i;
            let key = DpCtKey {
                sandbox_ip,
                remote_ip: u32::from_ne_bytes(remote.to_be_bytes()),
                guest_port: (40000 + (i % 20000) as u16).to_be(),
                remote_port: 443u16.to_be(),
                proto: libc::IPPROTO_TCP as u8,
                pad: [0; 3],
            };
            let val = DpCtVal {
                last_seen_ns: now,
                nat_port: (40000 + (i % 20000) as u16).to_be(),
                kind: DP_CT_SNAT,
                state: 0,
                generation,
                ..Default::default()
            };
            ct.insert(key, val, 0)
                .map_err(|e| format!("filling ct ({filled} flows): {e}"))?;
            filled += 1;
        }
        let warm = warm_ensure_release(conn, samples).await?;
        let pairs = pair_rate(conn, CONCURRENT_CALLERS, secs).await?;
        eprintln!(
            "  {flows} flows: release p50 {:.0} µs, {pairs:.0} pairs/s",
            warm.release.p50()
        );
        points.push(FlowPoint {
            flows,
            release: warm.release,
            pairs,
        });
    }
    Ok(Some(points))
}

// ------------------------------------------------------------------ report

struct Row {
    metric: String,
    value: String,
    floor: String,
    ratio: String,
    target: String,
    /// Whether the SPEC §10 target was met; None: no target (or a floor).
    met: Option<bool>,
}

impl Row {
    /// Marks the row's target as met or missed (shown in the table, and a
    /// miss sets exit code 3).
    fn met(mut self, met: bool) -> Row {
        self.met = Some(met);
        self.target = format!("{} ({})", self.target, if met { "met" } else { "MISSED" });
        self
    }
}

fn row(
    metric: impl Into<String>,
    value: impl Into<String>,
    floor: impl Into<String>,
    ratio: impl Into<String>,
    target: impl Into<String>,
) -> Row {
    Row {
        metric: metric.into(),
        value: value.into(),
        floor: floor.into(),
        ratio: ratio.into(),
        target: target.into(),
        met: None,
    }
}

/// One varlink call on `path`; every reply until the last (`continues`).
fn varlink_call(path: &Path, method: &str, more: bool) -> Result<Vec<serde_json::Value>> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let call = serde_json::json!({"method": method, "more": more});
    s.write_all(format!("{call}\0").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut out = vec![];
    loop {
        let mut buf = vec![];
        r.read_until(0, &mut buf).map_err(|e| e.to_string())?;
        if buf.pop() != Some(0) {
            return Err(format!("{method}: connection closed"));
        }
        let v: serde_json::Value = serde_json::from_slice(&buf).map_err(|e| e.to_string())?;
        if let Some(e) = v.get("error") {
            return Err(format!("{method}: {e}"));
        }
        let more = v.get("continues").and_then(serde_json::Value::as_bool) == Some(true);
        out.push(v);
        if !more {
            return Ok(out);
        }
    }
}

/// Full scrapes of the metrics socket with `n` networks: the agent's CPU
/// per scrape (every thread's schedstat), OpenMetrics and io.systemd.Metrics,
/// in `ROUNDS` rounds, each `SCRAPES` scrapes of one format then of the
/// other; the target holds only if every round's mean meets it.
fn scrape_rows(env: &Env, dir: &Path, n: usize, rows: &mut Vec<Row>) -> Result<()> {
    const ROUNDS: usize = 3;
    const SCRAPES: u32 = 3;
    // The fill's background work (pool refill, heap trim) must not be
    // billed to the first scrape.
    std::thread::sleep(Duration::from_secs(2));
    let sock = dir.join("report.sock");
    let formats = [
        (
            "OpenMetrics",
            "org.cube.NetworkAgent.Metrics.OpenMetrics",
            false,
        ),
        ("io.systemd.Metrics.List", "io.systemd.Metrics.List", true),
    ];
    // Per format: (agent CPU ms per round, wall ms per round, replies).
    let mut seen = [
        (Vec::new(), Vec::new(), 0usize),
        (Vec::new(), Vec::new(), 0),
    ];
    for _ in 0..ROUNDS {
        for ((_, method, more), (cpus, walls, size)) in formats.iter().zip(seen.iter_mut()) {
            let (mut cpu, mut wall) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..SCRAPES {
                let c0 = env.agent_cpu()?;
                let t0 = Instant::now();
                let replies = varlink_call(&sock, method, *more)?;
                wall += t0.elapsed();
                cpu += env.agent_cpu()? - c0;
                *size = replies.len();
            }
            cpus.push(cpu.as_secs_f64() * 1e3 / f64::from(SCRAPES));
            walls.push(wall.as_secs_f64() * 1e3 / f64::from(SCRAPES));
        }
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for ((what, _, _), (cpus, walls, size)) in formats.iter().zip(seen.iter()) {
        rows.push(
            row(
                format!("metrics scrape, {what}, {n} nets: agent CPU / wall, {ROUNDS} rounds of {SCRAPES}"),
                format!("{} ms / {} ms ({size} replies)", list(cpus), list(walls)),
                "-",
                "-",
                "agent CPU <= 50 ms in every round",
            )
            .met(cpus.iter().all(|&c| c <= 50.0)),
        );
    }
    Ok(())
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn ratio(value: f64, floor: f64) -> String {
    format!("{:.1}x", value / floor)
}

fn print_table(rows: &[Row]) {
    let w = |f: fn(&Row) -> &String, h: &str| {
        rows.iter()
            .map(|r| f(r).chars().count())
            .max()
            .unwrap_or(0)
            .max(h.len())
    };
    let (w0, w1, w2, w3) = (
        w(|r| &r.metric, "metric"),
        w(|r| &r.value, "value"),
        w(|r| &r.floor, "floor"),
        w(|r| &r.ratio, "ratio"),
    );
    let line = |a: &str, b: &str, c: &str, d: &str, e: &str| {
        let pad =
            |s: &str, n: usize| format!("{s}{}", " ".repeat(n.saturating_sub(s.chars().count())));
        println!(
            "{}  {}  {}  {}  {e}",
            pad(a, w0),
            pad(b, w1),
            pad(c, w2),
            pad(d, w3)
        );
    };
    line("metric", "value", "floor", "ratio", "target (SPEC §10)");
    for r in rows {
        line(&r.metric, &r.value, &r.floor, &r.ratio, &r.target);
    }
}

fn machine_facts() {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let model = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    println!(
        "machine: nproc {cpus}, kernel {}, cpu {model}",
        kernel.trim()
    );
    println!(
        "load average at start: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

// ------------------------------------------------------------------ main

/// Rows are pushed as phases finish, so a failure still shows what was measured.
async fn run(args: Args, rows: &mut Vec<Row>) -> std::result::Result<(), Failure> {
    let mut env = Env::new(&args).await.map_err(Failure::Setup)?;
    let result = phases(&mut env, &args, rows).await;
    if result.is_err() || args.keep {
        env.keep_tmp = true;
        eprintln!("temp dir kept: {}", env.tmp.display());
    }
    result.map_err(|e| {
        Failure::Broken(format!(
            "{e}\n(agent logs and state kept in {})",
            env.tmp.display()
        ))
    })
}

async fn phases(env: &mut Env, args: &Args, rows: &mut Vec<Row>) -> Result<()> {
    let s = args.samples;
    let n = args.networks;
    let conn = env.connect().await?;

    eprintln!("[1/10] floors: durable write, TAP create");
    let disk = floor_durable_write(&env.tmp, (s / 4).max(10))?;
    let journal = floor_journal_append(&env.tmp, (s / 4).max(10))?;
    let tap = floor_tap_create(200.min(s))?;

    eprintln!("[2/10] agent --warm-pool 64: start");
    let (ns, dir) = env.new_instance()?;
    let start_empty = env.start_agent(&ns, &dir, 64, n).await?;
    let zbus = floor_ping(&conn, s).await?;
    let fd = floor_open_tap(&conn, (s / 4).max(10)).await?;
    let ping16 = ping_rate(&conn, CONCURRENT_CALLERS, 1.0).await?;
    // The agent's store commits with append + fdatasync, so that (not the
    // rename dance) is the durable part of the floor for ensure/release.
    // Disk latency drifts on a shared machine, so it is re-measured right
    // before each latency phase.
    let disk_now =
        |env: &Env| -> Result<f64> { Ok(floor_journal_append(&env.tmp, (s / 8).max(10))?.p50()) };

    rows.push(row(
        "zbus Ping p50 / p99",
        zbus.show(),
        "-",
        "-",
        "floor: 60 / 110 µs",
    ));
    rows.push(row(
        "OpenTap (fd in reply) p50 / p99",
        fd.show(),
        format!("zbus {:.0} µs", zbus.p50()),
        ratio(fd.p50(), zbus.p50()),
        "floor: 68 µs",
    ));
    rows.push(row(
        format!("zbus Ping calls/s, {CONCURRENT_CALLERS} callers"),
        format!("{ping16:.0}/s"),
        "-",
        "-",
        "floor: ~32k/s",
    ));
    rows.push(row(
        "durable 1 KB write+fsync+rename p50 / p99",
        disk.show(),
        "-",
        "-",
        "floor: 344 µs",
    ));
    rows.push(row(
        "journal 1 KB append+fdatasync p50 / p99",
        journal.show(),
        "-",
        "-",
        "floor: 168 µs / commit",
    ));
    rows.push(row(
        "TAP create (TUNSETIFF) p50 / p99",
        tap.show(),
        "-",
        "-",
        "floor: 160 µs",
    ));
    rows.push(row(
        "start -> READY=1 (empty, pool 64)",
        format!("{:.1} ms", start_empty.as_secs_f64() * 1e3),
        "-",
        "-",
        "-",
    ));

    eprintln!("[3/10] warm EnsureNetwork / ReleaseNetwork x{s}");
    for i in 0..20 {
        let id = format!("bench-warmup-{i}");
        ensure(&conn, &id).await?;
        release(&conn, &id).await?;
    }
    let floor_warm = zbus.p50() + disk_now(env)?;
    let warm = warm_ensure_release(&conn, s).await?;
    let fw = format!("zbus+fdatasync {floor_warm:.0} µs");
    rows.push(
        row(
            "warm EnsureNetwork p50 / p99",
            warm.ensure.show(),
            fw.clone(),
            ratio(warm.ensure.p50(), floor_warm),
            "<= 800 / 2000 µs",
        )
        .met(warm.ensure.p50() <= 800.0 && warm.ensure.p99() <= 2000.0),
    );
    if let Some(clones) = clone_phase(&conn, CLONES, CONCURRENT_CALLERS).await? {
        rows.push(
            row(
                format!("EnsureNetwork with clone_of, one source, {CLONES} one at a time"),
                clones.serial.show(),
                format!("same spec given, alternating {}", clones.explicit.show()),
                ratio(clones.serial.p50(), clones.explicit.p50()),
                format!("p99 <= warm ensure p99 ({:.0} µs)", warm.ensure.p99()),
            )
            .met(clones.serial.p99() <= warm.ensure.p99()),
        );
        rows.push(row(
            format!("EnsureNetwork with clone_of, {CLONES} clones kept, {CONCURRENT_CALLERS} callers at once"),
            clones.burst.show(),
            format!("same spec given, same burst {}", clones.explicit_burst.show()),
            ratio(clones.burst.p99(), clones.explicit_burst.p99()),
            "-",
        ));
        rows.push(
            row(
                format!(
                    "first frame of each of the {CLONES} clones answered, from its OpenTap ({CONCURRENT_CALLERS} at once), p50 / p99"
                ),
                clones.first_answer.show(),
                format!(
                    "the source's, one at a time {}",
                    clones.source_first_answer.show()
                ),
                ratio(
                    clones.first_answer.p99(),
                    clones.source_first_answer.p99(),
                ),
                "every one <= 1 s",
            )
            .met(clones.first_answer.max() <= 1_000_000.0),
        );
    } else {
        eprintln!("  clone rows skipped: the agent under test has no clone_of");
    }
    rows.push(
        row(
            "ReleaseNetwork p50 / p99",
            warm.release.show(),
            fw,
            ratio(warm.release.p50(), floor_warm),
            "p50 <= 1000 µs",
        )
        .met(warm.release.p50() <= 1000.0),
    );

    eprintln!(
        "[4/10] throughput, 1 and {CONCURRENT_CALLERS} callers, {:.0} s each",
        args.throughput_secs
    );
    let t1 = pair_rate(&conn, 1, args.throughput_secs).await?;
    let c16 = costed(
        env.agent_pid()?,
        args.throughput_secs,
        pair_rate(&conn, CONCURRENT_CALLERS, args.throughput_secs),
    )
    .await?;
    let t16 = c16.rate;
    // Every signal the agent emits while 16 callers run pairs, counted by a
    // second connection that asked the bus for all of them (the bus then
    // delivers each signal once more, to it: a run of its own).
    let signals = SignalCounter::start(env).await?;
    let t16_listened = pair_rate(&conn, CONCURRENT_CALLERS, args.throughput_secs).await?;
    let (signal_count, pairs_done) = (signals.stop().await, t16_listened * args.throughput_secs);
    // The same calls and signals against a server that does nothing else.
    let floor_server = FloorProc::start(env, None)?;
    let f16 = floor_server
        .pair_rate(&conn, CONCURRENT_CALLERS, args.throughput_secs)
        .await?;
    drop(floor_server);
    // The same, plus the kernel work of the safe TAP lifecycle.
    let (kns, _) = env.new_instance()?;
    let kernel_floor = FloorProc::start(env, Some(&kns))?;
    let kc16 = costed(
        kernel_floor.child.id(),
        args.throughput_secs,
        kernel_floor.pair_rate(&conn, CONCURRENT_CALLERS, args.throughput_secs),
    )
    .await?;
    let k16 = kc16.rate;
    drop(kernel_floor);
    let serial_cap = 1e6 / (2.0 * floor_warm);
    rows.push(row(
        "ensure+release pairs/s, 1 caller",
        format!("{t1:.0}/s"),
        format!("serial zbus+fdatasync {serial_cap:.0}/s"),
        ratio(serial_cap, t1),
        "-",
    ));
    rows.push(
        row(
            format!("ensure+release pairs/s, {CONCURRENT_CALLERS} callers"),
            format!("{t16:.0}/s"),
            format!("bus floor {f16:.0}/s"),
            ratio(f16, t16),
            ">= 10000/s",
        )
        .met(t16 >= 10_000.0),
    );
    rows.push(row(
        format!(
            "ensure+release pairs/s, {CONCURRENT_CALLERS} callers, a listener for every signal"
        ),
        format!("{t16_listened:.0}/s"),
        "-",
        "-",
        "-",
    ));
    let efficiency = 2.0 * t16 / ping16;
    rows.push(
        row(
            format!("efficiency: 2·pairs/s ÷ Ping calls/s, {CONCURRENT_CALLERS} callers"),
            format!("{efficiency:.2}"),
            format!("Ping {ping16:.0}/s"),
            "-",
            ">= 0.5",
        )
        .met(efficiency >= 0.5),
    );
    rows.push(row(
        format!(
            "bus floor: same calls, replies and signals, no work, pairs/s, {CONCURRENT_CALLERS} callers"
        ),
        format!("{f16:.0}/s"),
        "-",
        "-",
        "-",
    ));
    rows.push(
        row(
            format!(
                "pairs/s vs the safe-lifecycle floor (bus + TAP create, up, retire, batched delete), {CONCURRENT_CALLERS} callers"
            ),
            format!("{t16:.0}/s"),
            format!("floor {k16:.0}/s"),
            format!("{:.2}x", t16 / k16.max(1.0)),
            ">= 0.8x",
        )
        .met(t16 >= 0.8 * k16),
    );
    rows.push(row(
        format!(
            "server CPU per pair (every thread, kernel work included), {CONCURRENT_CALLERS} callers"
        ),
        format!(
            "{:.0} µs (machine {:.0} % busy)",
            c16.cpu_per_pair_us,
            100.0 * c16.busy
        ),
        format!(
            "safe-lifecycle floor {:.0} µs ({:.0} % busy)",
            kc16.cpu_per_pair_us,
            100.0 * kc16.busy
        ),
        ratio(c16.cpu_per_pair_us, kc16.cpu_per_pair_us),
        "-",
    ));
    rows.push(row(
        "bus floor efficiency: 2·floor pairs/s ÷ Ping calls/s",
        format!("{:.2}", 2.0 * f16 / ping16),
        format!("Ping {ping16:.0}/s"),
        "-",
        "(the most the agent could reach)",
    ));
    // The VMM's lifecycle: the TAP fd handed out and closed before the
    // release (the TAP is then deleted rather than pooled).
    let vmm16 = vmm_pair_rate(&conn, CONCURRENT_CALLERS, args.throughput_secs).await?;
    rows.push(row(
        format!(
            "VMM lifecycle pairs/s (Ensure, OpenTap, close, Release), {CONCURRENT_CALLERS} callers"
        ),
        format!("{vmm16:.0}/s"),
        format!("pairs {t16:.0}/s"),
        ratio(t16, vmm16),
        "-",
    ));
    let varlink_path = dir.join("run/org.cube.NetworkAgent");
    let vl16 = varlink_pair_rate(&varlink_path, CONCURRENT_CALLERS, args.throughput_secs).await?;
    rows.push(row(
        format!("ensure+release pairs/s over varlink, {CONCURRENT_CALLERS} callers"),
        format!("{vl16:.0}/s"),
        format!("D-Bus {t16:.0}/s"),
        format!("{:.2}x of D-Bus", vl16 / t16.max(1.0)),
        "-",
    ));
    let per_pair = signal_count as f64 / pairs_done.max(1.0);
    rows.push(row(
        "bus messages per ensure+release pair",
        format!(
            "{:.1} (4 calls/replies + {per_pair:.1} signals)",
            4.0 + per_pair
        ),
        "-",
        "-",
        "-",
    ));

    eprintln!("[5/10] ReleaseNetwork and pairs/s with 0, 10k and 100k flows in ct");
    match flow_load(
        &conn,
        &dir.join("bpf"),
        (s / 4).max(20),
        args.throughput_secs,
    )
    .await?
    {
        None => rows.push(row(
            "release with flows in ct",
            "skipped (no eBPF datapath: no pinned ct map)",
            "-",
            "-",
            "-",
        )),
        Some(points) => {
            for p in &points {
                rows.push(row(
                    format!("ReleaseNetwork p50 / p99, {} flows in ct", p.flows),
                    p.release.show(),
                    "-",
                    "-",
                    "-",
                ));
                rows.push(row(
                    format!(
                        "ensure+release pairs/s, {CONCURRENT_CALLERS} callers, {} flows in ct",
                        p.flows
                    ),
                    format!("{:.0}/s", p.pairs),
                    "-",
                    "-",
                    "-",
                ));
            }
            let (first, last) = (&points[0], &points[points.len() - 1]);
            let r = last.release.p50() / first.release.p50();
            rows.push(
                row(
                    format!("release p50, {} flows / {} flows", last.flows, first.flows),
                    format!("{r:.2}"),
                    "-",
                    "-",
                    "<= 1.2",
                )
                .met(r <= 1.2),
            );
            let r = last.pairs / first.pairs;
            rows.push(
                row(
                    format!("pairs/s, {} flows / {} flows", last.flows, first.flows),
                    format!("{r:.2}"),
                    "-",
                    "-",
                    ">= 0.8",
                )
                .met(r >= 0.8),
            );
        }
    }
    env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;

    if let Some(base) = &args.baseline_agent {
        baseline_rows(env, &conn, base, n, args.throughput_secs, rows).await?;
    }

    let max = args.networks_max;
    eprintln!("[6/10] agent --warm-pool 0: cold EnsureNetwork x{s} with 0 networks");
    let (ns, dir) = env.new_instance()?;
    env.start_agent(&ns, &dir, 0, max).await?;
    let floor_cold = zbus.p50() + disk_now(env)? + tap.p50();
    let fc = format!("zbus+fdatasync+TAP {floor_cold:.0} µs");
    let cold0 = cold_ensures(&conn, "cold0", s).await?;
    rows.push(
        row(
            "cold EnsureNetwork, 0 nets, p50 / p99",
            cold0.show(),
            fc,
            ratio(cold0.p50(), floor_cold),
            "p50 <= 1500 µs",
        )
        .met(cold0.p50() <= 1500.0),
    );

    eprintln!("[7/10] fill to {n} networks with {CONCURRENT_CALLERS} callers");
    let fill_time = fill(&conn, 0, n).await?;
    rows.push(row(
        format!("fill to {n} networks ({CONCURRENT_CALLERS} callers)"),
        format!(
            "{:.2} s ({:.0}/s)",
            fill_time.as_secs_f64(),
            n as f64 / fill_time.as_secs_f64()
        ),
        "-",
        "-",
        "-",
    ));
    cold_point(
        env,
        &conn,
        rows,
        &format!("{n} nets"),
        &cold0,
        (s / 4).max(10),
        zbus.p50() + tap.p50(),
    )
    .await?;
    let mut v = Vec::with_capacity(200);
    for _ in 0..200 {
        v.push(timed(capacity(&conn)).await?);
    }
    let cap = Lat::new(v);
    rows.push(
        row(
            format!("Capacity over D-Bus, {n} nets, p50 / p99"),
            cap.show(),
            format!("zbus Ping {:.0} µs", zbus.p50()),
            ratio(cap.p50(), zbus.p50()),
            "p50 <= 100 µs",
        )
        .met(cap.p50() <= 100.0),
    );
    let rss = env.agent_rss_kb()?;
    rows.push(
        row(
            format!("agent RSS with {n} networks"),
            format!("{:.1} MB", rss as f64 / 1024.0),
            "-",
            "-",
            "<= 50 MB (10k)",
        )
        .met(rss as f64 / 1024.0 <= 50.0),
    );

    if env.agent_has_report_socket() {
        scrape_rows(env, &dir, n, rows)?;
    }

    eprintln!("[8/10] restart with {n} networks");
    let killed = env.stop_agent(nix::sys::signal::Signal::SIGKILL).await?;
    rows.push(row(
        format!("SIGKILL -> agent process gone, {n} nets"),
        ms(killed),
        "-",
        "-",
        "- (kernel closes every TAP fd)",
    ));
    let after_kill = env.start_agent(&ns, &dir, 0, max).await?;
    ping(&conn).await?;
    rows.push(
        row(
            format!("restart after SIGKILL: spawn -> READY, {n} nets"),
            ms(after_kill),
            "-",
            "-",
            "<= 1000 ms (10k)",
        )
        .met(after_kill <= Duration::from_secs(1)),
    );
    if killed < QUICK_EXIT {
        let stop = env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        let after_term = env.start_agent(&ns, &dir, 0, max).await?;
        rows.push(row(
            format!("SIGTERM -> exit, {n} nets"),
            ms(stop),
            "-",
            "-",
            "-",
        ));
        rows.push(
            row(
                format!("restart after SIGTERM: spawn -> READY, {n} nets"),
                ms(after_term),
                "-",
                "-",
                "<= 1000 ms (10k)",
            )
            .met(after_term <= Duration::from_secs(1)),
        );
    } else {
        rows.push(row(
            "SIGTERM stop + restart",
            format!("skipped (exit took {:.0} s)", killed.as_secs_f64()),
            "-",
            "-",
            "-",
        ));
    }

    if let Some(next) = &args.next_agent {
        eprintln!(
            "[9/10] upgrade in place to {} with {n} networks",
            next.display()
        );
        let before = programs(&conn).await?;
        env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        let this = std::mem::replace(&mut env.agent_bin, next.clone());
        let ready = env.start_agent(&ns, &dir, 0, max).await?;
        let at_ready = Instant::now();
        let after = programs(&conn).await?;
        if after.get("from_guest") == before.get("from_guest") {
            return Err(format!(
                "--next-agent runs the same from_guest ({:?}): build one with tests/upgrade/build-next.sh",
                after.get("from_guest")
            ));
        }
        let switched = until_block_runs(&ns, &after["from_guest"], at_ready).await?;
        env.agent_bin = this;
        rows.push(row(
            format!("upgrade (SIGTERM, new build): spawn -> READY, {n} nets"),
            ms(ready),
            "-",
            "-",
            "- (includes the verifier: ~1 s)",
        ));
        rows.push(
            row(
                format!("READY -> every TAP on the new from_guest, {n} nets"),
                match switched {
                    None => "0 ms (switched before READY)".into(),
                    Some(d) => ms(d),
                },
                "-",
                "-",
                "<= 1000 ms",
            )
            .met(switched.is_none_or(|d| d <= Duration::from_secs(1))),
        );
    } else {
        eprintln!("[9/10] upgrade in place: skipped (no --next-agent)");
    }

    if max > n {
        // The agent holds one descriptor per TAP: past its RLIMIT_NOFILE
        // (a hard limit only CAP_SYS_RESOURCE raises) the rest of the
        // point's TAPs are the bench's own, bound to the same block, as
        // the kernel cost that could grow is per TAP on the node.
        let budget = nofile_limit().saturating_sub(2_000) as usize;
        let nets = max.min(budget.max(n));
        let extra = max - nets;
        eprintln!(
            "[10/10] fill to {nets} networks{}, cold EnsureNetwork again",
            if extra > 0 {
                format!(" + {extra} TAPs of the bench's bound to the block (RLIMIT_NOFILE)")
            } else {
                String::new()
            }
        );
        let fill_time = fill(&conn, n, nets).await?;
        rows.push(row(
            format!("fill {n} -> {nets} networks ({CONCURRENT_CALLERS} callers)"),
            format!("{:.2} s", fill_time.as_secs_f64()),
            "-",
            "-",
            "-",
        ));
        if extra > 0 {
            let ns2 = ns.clone();
            tokio::task::spawn_blocking(move || in_netns(&ns2, || bound_taps(extra)))
                .await
                .map_err(|e| e.to_string())??;
            rows.push(row(
                format!(
                    "(RLIMIT_NOFILE {} < {max}: + {extra} TAPs bound to the block by the bench)",
                    nofile_limit()
                ),
                format!("{} TAPs", nets + extra),
                "-",
                "-",
                "-",
            ));
        }
        let label = if extra > 0 {
            format!("{nets} nets + {extra} bound TAPs")
        } else {
            format!("{max} nets")
        };
        cold_point(
            env,
            &conn,
            rows,
            &label,
            &cold0,
            (s / 4).max(10),
            zbus.p50() + tap.p50(),
        )
        .await?;
    }
    // Still serving after the restarts. The agent is killed by Env's Drop
    // without waiting: with 10k TAPs its exit takes long and needs no timing.
    timed(ensure(&conn, "bench-final-0")).await?;
    Ok(())
}

/// Cold EnsureNetwork at `nets` networks, and its p50 against the same
/// run's at 0 networks (the attach cost must not grow with the node).
async fn cold_point(
    env: &mut Env,
    conn: &Connection,
    rows: &mut Vec<Row>,
    nets: &str,
    cold0: &Lat,
    samples: usize,
    floor_no_disk: f64,
) -> Result<()> {
    let floor_cold = floor_no_disk + floor_journal_append(&env.tmp, (samples / 2).max(10))?.p50();
    let phase: String = format!("cold{nets}")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let coldn = cold_ensures(conn, &phase, samples).await?;
    rows.push(
        row(
            format!("cold EnsureNetwork, {nets}, p50 / p99"),
            coldn.show(),
            format!("zbus+fdatasync+TAP {floor_cold:.0} µs"),
            ratio(coldn.p50(), floor_cold),
            "p50 <= 2000 µs (10k)",
        )
        .met(coldn.p50() <= 2000.0),
    );
    let r = coldn.p50() / cold0.p50();
    rows.push(
        row(
            format!("cold EnsureNetwork p50, {nets} / 0 nets"),
            format!("{r:.2}"),
            "-",
            "-",
            "<= 1.2",
        )
        .met(r <= 1.2),
    );
    Ok(())
}

/// The running agent's programs and tags (Health's datapath_programs).
async fn programs(conn: &Connection) -> Result<HashMap<String, u64>> {
    let (_, checks): (bool, Vec<(String, bool, String)>) = conn
        .call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "Health", &())
        .await
        .map_err(|e| format!("Health: {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("Health: {e}"))?;
    let d = checks
        .iter()
        .find(|c| c.0 == "datapath_programs")
        .map(|c| c.2.clone())
        .ok_or("Health has no datapath_programs check")?;
    let list = d
        .strip_prefix("this build's programs: ")
        .and_then(|r| r.split(';').next())
        .ok_or_else(|| format!("unexpected datapath_programs: {d}"))?;
    list.split(", ")
        .map(|p| {
            let (name, tag) = p.split_once(' ').ok_or_else(|| format!("bad entry {p}"))?;
            let tag = u64::from_str_radix(tag, 16).map_err(|e| format!("{tag}: {e}"))?;
            Ok((name.to_owned(), tag))
        })
        .collect()
}

/// How long after `since` the shared block's filter (every bound TAP's
/// from_guest) ran the program tagged `tag`: None if it already did at
/// the first look.
async fn until_block_runs(ns: &str, tag: &u64, since: Instant) -> Result<Option<Duration>> {
    let (ns, tag) = (ns.to_owned(), *tag);
    let mut first = true;
    loop {
        let ns2 = ns.clone();
        let now = tokio::task::spawn_blocking(move || in_netns(&ns2, block_tag))
            .await
            .map_err(|e| e.to_string())??;
        if now == Some(tag) {
            return Ok((!first).then(|| since.elapsed()));
        }
        first = false;
        if since.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "the block still runs {now:?} 30 s after READY, not {tag:x}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn block_tag() -> Result<Option<u64>> {
    use cube_network_agent::datapath::tc;
    let block = cube_network_agent::config::Config::default().tc_block;
    Ok(tc::bpf_filters(tc::Target::Block(block))
        .map_err(|e| format!("dumping the block's filters: {e}"))?
        .first()
        .map(|f| f.tag))
}

/// Runs `f` on a thread inside the network namespace `ns`.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let fd = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("setns {path}: {e}"))?;
            f()
        })
        .join()
        .map_err(|_| "netns thread panicked".to_string())?
    })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--serve-floor") {
        let Some(address) = argv.get(2) else {
            eprintln!("--serve-floor needs a bus address");
            return ExitCode::from(EXIT_SETUP);
        };
        let kernel = argv.get(3).map(String::as_str) == Some("--kernel");
        return match floor::serve(address, kernel) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cube-netbench --serve-floor: {e}");
                ExitCode::from(EXIT_SETUP)
            }
        };
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_SETUP);
        }
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("cube-netbench: must run as root (network namespaces, TAPs)");
        return ExitCode::from(EXIT_SETUP);
    }
    // The agents get the descriptors the shipped unit gives them
    // (LimitNOFILE=65536) where the hard limit allows: one per TAP.
    raise_nofile(65_536);
    machine_facts();
    println!(
        "agent: {}; N={} networks, S={} samples; bench, agent and dbus-daemon share the machine",
        args.agent.display(),
        args.networks,
        args.samples
    );
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-netbench: tokio runtime: {e}");
            return ExitCode::from(EXIT_SETUP);
        }
    };
    let mut rows = vec![];
    let result = rt.block_on(async {
        tokio::select! {
            r = run(args, &mut rows) => r,
            _ = tokio::signal::ctrl_c() => Err(Failure::Interrupted),
        }
    });
    if !rows.is_empty() {
        println!();
        if result.is_err() {
            println!("PARTIAL RESULTS (the run failed; see below)");
        }
        print_table(&rows);
    }
    match result {
        Ok(()) => {
            println!(
                "\nratio = value / floor for latencies, floor / value for rates; floors measured in this run."
            );
            println!(
                "the fdatasync part of each ensure/release floor is re-measured right before that phase."
            );
            let missed: Vec<&str> = rows
                .iter()
                .filter(|r| r.met == Some(false))
                .map(|r| r.metric.as_str())
                .collect();
            if missed.is_empty() {
                ExitCode::SUCCESS
            } else {
                println!(
                    "SPEC §10 target missed: {} (exit {EXIT_TARGET_MISSED}: informational, every call answered)",
                    missed.join("; ")
                );
                ExitCode::from(EXIT_TARGET_MISSED)
            }
        }
        Err(Failure::Broken(e)) => {
            eprintln!("cube-netbench: FAILED: {e}");
            ExitCode::from(EXIT_BROKEN)
        }
        Err(Failure::Setup(e)) => {
            eprintln!("cube-netbench: setup failed: {e}");
            ExitCode::from(EXIT_SETUP)
        }
        Err(Failure::Interrupted) => {
            eprintln!("cube-netbench: interrupted");
            ExitCode::from(EXIT_INTERRUPTED)
        }
    }
}
