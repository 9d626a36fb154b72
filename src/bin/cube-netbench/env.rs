//! The bench environment: private network namespaces, a private
//! dbus-daemon, temp state, bpffs mounts and the agent process (start,
//! READY, stop); `Drop` removes all of it. Also the descriptor limit and
//! the TAPs the bench binds itself.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cube_network_agent::tap::Tap;
use zbus::Connection;

use crate::args::Args;
use crate::calls::{CALL_TIMEOUT, Result};

/// Recovery of 10k networks can be slow; a run waits this long for READY=1.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a signalled agent may take to exit.
pub(crate) const EXIT_TIMEOUT: Duration = Duration::from_secs(900);

/// One running agent: `ip netns exec NS AGENT ...`. `ip netns exec` execs
/// the agent, so the child's pid is the agent's pid.
pub(crate) struct AgentProc {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl AgentProc {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Owns everything the bench creates; `Drop` removes all of it.
pub(crate) struct Env {
    pub(crate) pid: u32,
    pub(crate) tmp: PathBuf,
    pub(crate) netns: Vec<String>,
    pub(crate) bus: Option<Child>,
    pub(crate) bus_addr: String,
    pub(crate) agent: Option<AgentProc>,
    pub(crate) agent_bin: PathBuf,
    pub(crate) notify_path: PathBuf,
    /// READY=1 messages seen so far. A thread drains the notify socket all
    /// the time, as a service manager does: the agent pushes every TAP fd
    /// to the fd store (FDSTORE=1), and an undrained socket would make
    /// those sends wait.
    pub(crate) ready_count: Arc<AtomicU64>,
    pub(crate) ready_seen: u64,
    /// bpffs mounts to remove at the end.
    pub(crate) mounts: Vec<PathBuf>,
    pub(crate) runs: usize,
    /// Set on failure: the temp dir (with the agent logs) is left in place.
    pub(crate) keep_tmp: bool,
}

pub(crate) fn run_cmd(cmd: &mut Command) -> Result<()> {
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
pub(crate) fn die_with_parent(cmd: &mut Command) -> &mut Command {
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
    pub(crate) async fn new(args: &Args) -> Result<Env> {
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

    pub(crate) fn start_bus(&mut self, config: &Path) -> Result<()> {
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

    pub(crate) async fn connect(&self) -> Result<Connection> {
        zbus::connection::Builder::address(self.bus_addr.as_str())
            .map_err(|e| format!("bus address {}: {e}", self.bus_addr))?
            .method_timeout(CALL_TIMEOUT)
            .build()
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.bus_addr))
    }

    /// A fresh namespace + state dir for a new agent instance.
    pub(crate) fn new_instance(&mut self) -> Result<(String, PathBuf)> {
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
    pub(crate) async fn start_agent(
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

    pub(crate) fn runs_of(&self, dir: &Path) -> usize {
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
    pub(crate) fn drain_notify(&mut self) {
        self.ready_seen = self.ready_count.load(Ordering::SeqCst);
    }

    /// Waits for READY=1 on the notify socket while watching the child.
    pub(crate) async fn wait_ready(&mut self) -> Result<()> {
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

    pub(crate) fn log_path(&self) -> String {
        self.agent
            .as_ref()
            .map_or_else(|| "(no agent)".into(), |a| a.log.display().to_string())
    }

    pub(crate) fn agent_pid(&self) -> Result<u32> {
        self.agent
            .as_ref()
            .map(AgentProc::pid)
            .ok_or_else(|| "no agent running".into())
    }

    /// Sends `sig` and waits for the agent to exit; returns how long it took.
    /// The kernel detaches every TAP fd on exit (one RCU grace period
    /// each), so an agent holding 10k TAPs may take minutes to die.
    pub(crate) async fn stop_agent(&mut self, sig: nix::sys::signal::Signal) -> Result<Duration> {
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
    pub(crate) fn agent_has_report_socket(&self) -> bool {
        Command::new(&self.agent_bin)
            .arg("--help")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--report-socket"))
    }

    /// The agent's CPU time so far (every thread, from schedstat: ns).
    pub(crate) fn agent_cpu(&self) -> Result<Duration> {
        process_cpu(self.agent_pid()?)
    }

    pub(crate) fn agent_rss_kb(&self) -> Result<u64> {
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

/// Ensures `n` networks with concurrent callers; returns the wall time.
/// This process's (and so the agents') RLIMIT_NOFILE.
pub(crate) fn nofile_limit() -> u64 {
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
pub(crate) fn bound_taps(n: usize) -> Result<()> {
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
pub(crate) fn raise_nofile(want: u64) {
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

/// Runs `f` on a thread inside the network namespace `ns`.
pub(crate) fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
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

/// A process's CPU time so far: every thread's on-CPU time from
/// schedstat, kernel work done in its system calls included (ns).
pub(crate) fn process_cpu(pid: u32) -> Result<Duration> {
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
pub(crate) fn machine_cpu() -> (u64, u64) {
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
