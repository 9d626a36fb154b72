//! Test harness: each `Env` is its own network namespace, private
//! dbus-daemon (config in tests/data/bus.conf) and temporary state, with the
//! real agent binary running inside the namespace. Everything is torn down
//! in `Drop`, so a failing test cleans up too.

#![allow(dead_code)]

pub mod ctr;
pub mod dnsd;
pub mod dnsmasq;
pub mod flow;
pub mod flows;
pub mod gateway;
pub mod guest;
pub mod world;

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use zbus::zvariant::{OwnedValue, Value};

pub const NAME: &str = "org.cube.NetworkAgent";
pub const PATH: &str = "/org/cube/NetworkAgent";
pub const IFACE: &str = "org.cube.NetworkAgent";

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`...).
pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// True when the environment variable `CI` is set (to anything but "",
/// "0" or "false"): `.ci/run` runs with `CI=true`.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// The one rule for tests that need root: true when root (run the test);
/// not root and not in CI (a developer's `cargo test`): false after a
/// "skipping" message; not root under CI: panics, so a CI run can never
/// count a skipped test as passed. Shell suites follow the same rule
/// (tests/root.sh).
pub fn root_or_skip() -> bool {
    if is_root() {
        return true;
    }
    if in_ci() {
        panic!("needs root; CI must run as root (this test creates network namespaces and TAPs)");
    }
    eprintln!("skipping: this test creates network namespaces and TAPs and needs root");
    false
}

/// Returns from the test early with a message when not root, outside CI;
/// under CI (`CI` set) a test that is not root fails (see `root_or_skip`).
#[macro_export]
macro_rules! require_root {
    () => {
        if !common::root_or_skip() {
            return;
        }
    };
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The agent binary the tests run: this build's, or `CNA_TEST_AGENT` (an
/// A/B run against another build, e.g. to see a test fail on the release
/// before a fix).
pub fn agent_binary() -> std::ffi::OsString {
    std::env::var_os("CNA_TEST_AGENT")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cube-network-agent").into())
}

pub struct Env {
    pub ns: String,
    pub dir: PathBuf,
    pub address: String,
    bus: Child,
    agent: Option<Child>,
    args: Vec<String>,
    starts: u32,
    /// The binary the next start runs (default: [`agent_binary`]); the
    /// upgrade test switches builds with it.
    pub binary: Option<std::ffi::OsString>,
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("running a command");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Env {
    /// A namespace, a bus and a started agent with extra `args`.
    pub fn new(args: &[&str]) -> Env {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let ns = format!("cnat-{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(&ns);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        run(Command::new("ip").args(["netns", "add", &ns]));
        // A bpffs of its own for the agent's pinned maps: `ip netns exec`
        // remounts /sys, so /sys/fs/bpf would be a different (or no) bpffs
        // on every start and pins would not survive a restart.
        let bpf = dir.join("bpf");
        std::fs::create_dir_all(&bpf).unwrap();
        run(Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&bpf));
        run(Command::new("ip").args(["-n", &ns, "link", "set", "lo", "up"]));
        let sock = dir.join("bus.sock");
        let address = format!("unix:path={}", sock.display());
        let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bus.conf");
        let mut bus = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .arg(format!("--address={address}"))
            .args(["--nofork", "--nopidfile", "--print-address"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting dbus-daemon (apt-get install dbus-daemon)");
        let mut line = String::new();
        BufReader::new(bus.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("unix:"),
            "dbus-daemon did not start: {line:?}"
        );
        let mut env = Env {
            ns,
            dir,
            address,
            bus,
            agent: None,
            args: args.iter().map(|s| s.to_string()).collect(),
            starts: 0,
            binary: None,
        };
        env.start_agent();
        env
    }

    /// The extra arguments of the next start.
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|s| s.to_string()).collect();
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!("agent-{}.log", self.starts))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Starts the agent and waits until it owns its name.
    pub fn start_agent(&mut self) {
        if let Err((status, log)) = self.try_start_agent() {
            panic!("agent exited with {status} during start:\n{log}");
        }
    }

    /// [`Env::start_agent`], or how the agent exited during its start (and
    /// its log).
    pub fn try_start_agent(&mut self) -> Result<(), (std::process::ExitStatus, String)> {
        assert!(self.agent.is_none());
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(self.binary.clone().unwrap_or_else(agent_binary))
            .args(["--bus", &self.address])
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--runtime-dir")
            .arg(self.dir.join("run"))
            .arg("--report-socket")
            .arg(self.dir.join("report/org.cube.NetworkAgent"))
            .args(["--config", "/dev/null", "--log-level", "debug"])
            .arg("--bpf-pin-dir")
            .arg(self.dir.join("bpf"))
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.agent.as_mut().unwrap().try_wait().unwrap() {
                self.agent = None;
                return Err((status, self.log()));
            }
            let out = Command::new("busctl")
                .args(["--address", &self.address, "status", NAME])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            if out.success() {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "agent not ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn agent_pid(&self) -> u32 {
        self.agent.as_ref().unwrap().id()
    }

    /// kill -9 the agent.
    pub fn kill_agent(&mut self) {
        if let Some(mut child) = self.agent.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop_agent(&mut self) -> std::process::ExitStatus {
        let mut child = self.agent.take().unwrap();
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().unwrap()
    }

    pub fn agent_running(&mut self) -> bool {
        matches!(self.agent.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    pub async fn client(&self) -> Client {
        let conn = zbus::connection::Builder::address(self.address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap();
        Client { conn }
    }

    /// `ip -j -d link` inside the namespace: name → (kind, up, mtu, ifindex).
    /// Host ends of live CNI veths (`ctap` + 8 hex, named like sandbox
    /// TAPs; released ones are renamed).
    #[allow(dead_code)]
    pub fn cni_veths(&self) -> Vec<String> {
        self.links()
            .into_iter()
            .filter(|(n, l)| {
                l.kind == "veth"
                    && n.strip_prefix("ctap")
                        .is_some_and(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            })
            .map(|(n, _)| n)
            .collect()
    }

    pub fn links(&self) -> HashMap<String, Link> {
        let out = run(Command::new("ip").args(["-n", &self.ns, "-j", "-d", "link", "show"]));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|l| {
                let name = l["ifname"].as_str().unwrap().to_owned();
                let link = Link {
                    ifindex: l["ifindex"].as_u64().unwrap() as u32,
                    kind: l["linkinfo"]["info_kind"].as_str().unwrap_or("").to_owned(),
                    up: l["flags"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|x| x == "UP")),
                    mtu: l["mtu"].as_u64().unwrap_or(0) as u32,
                    retiring: l["group"].as_u64() == Some(RETIRE_GROUP)
                        || l["group"].as_str() == Some(&RETIRE_GROUP.to_string()),
                };
                (name, link)
            })
            .collect()
    }

    /// TAPs in use by sandboxes: the agent's TAPs that are up and not
    /// retiring (a TAP keeps its pool name `ctapw…` for life; older records
    /// name theirs after the sandbox address, `ctap` + 8 hex). Pool TAPs
    /// are down; released ones move to the retire group at once.
    pub fn sandbox_taps(&self) -> BTreeSet<String> {
        self.links()
            .into_iter()
            .filter(|(n, l)| l.kind == "tun" && n.starts_with("ctap") && l.up && !l.retiring)
            .map(|(n, _)| n)
            .collect()
    }

    /// Idle pool TAPs: pool-named and down.
    pub fn pool_taps(&self) -> BTreeSet<String> {
        self.links()
            .into_iter()
            .filter(|(n, l)| l.kind == "tun" && n.starts_with("ctapw") && !l.up)
            .map(|(n, _)| n)
            .collect()
    }

    /// Permanent IPv4 neighbour entries on cube-dev (one per sandbox):
    /// ip → mac. (Its one IPv6 entry, the gateway's link-local address
    /// that `ipv6_pool`'s route goes via, is the node's, not a sandbox's.)
    pub fn neighbours(&self) -> BTreeSet<(String, String)> {
        let out = run(Command::new("ip").args([
            "-n", &self.ns, "-4", "-j", "neigh", "show", "dev", "cube-dev",
        ]));
        let v: serde_json::Value =
            serde_json::from_str(if out.trim().is_empty() { "[]" } else { &out }).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .filter(|n| {
                n["state"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|x| x == "PERMANENT"))
            })
            .map(|n| {
                (
                    n["dst"].as_str().unwrap().to_owned(),
                    n["lladdr"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    }

    /// Runs a command inside the namespace.
    pub fn ns_cmd(&self, args: &[&str]) -> String {
        run(Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .args(args))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.kill_agent();
        let _ = self.bus.kill();
        let _ = self.bus.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("umount").arg(self.dir.join("bpf")).status();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kept {} for inspection", self.dir.display());
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub ifindex: u32,
    pub kind: String,
    pub up: bool,
    pub mtu: u32,
    /// In the agent's retire group (49342): released, deleted with the
    /// next batch.
    pub retiring: bool,
}

/// The agent's default `retire_group`.
pub const RETIRE_GROUP: u64 = 0xc0be;

pub type Dict = HashMap<String, OwnedValue>;

/// A D-Bus error as (name, message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    pub name: String,
    pub message: String,
}

fn call_error(e: zbus::Error) -> CallError {
    match e {
        zbus::Error::MethodError(name, msg, _) => CallError {
            name: name.to_string(),
            message: msg.unwrap_or_default(),
        },
        other => CallError {
            name: "transport".into(),
            message: other.to_string(),
        },
    }
}

pub fn opts(pairs: Vec<(&str, Value<'_>)>) -> Dict {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.try_to_owned().unwrap()))
        .collect()
}

pub fn ports(list: &[(&str, u16, u16, &str)]) -> Value<'static> {
    Value::from(
        list.iter()
            .map(|(p, c, h, ip)| (p.to_string(), *c, *h, ip.to_string()))
            .collect::<Vec<_>>(),
    )
}

pub fn s(d: &Dict, k: &str) -> String {
    String::try_from(d[k].try_clone().unwrap()).unwrap()
}

pub fn u(d: &Dict, k: &str) -> u32 {
    u32::try_from(d[k].try_clone().unwrap()).unwrap()
}

pub fn mappings(d: &Dict) -> Vec<(String, u16, u16, String)> {
    Vec::try_from(d["port_mappings"].try_clone().unwrap()).unwrap()
}

#[derive(Clone)]
pub struct Client {
    pub conn: zbus::Connection,
}

impl Client {
    pub async fn call<B, R>(&self, method: &str, body: &B) -> Result<R, CallError>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        let reply = self
            .conn
            .call_method(Some(NAME), PATH, Some(IFACE), method, body)
            .await
            .map_err(call_error)?;
        Ok(reply.body().deserialize().unwrap())
    }

    pub async fn ensure(&self, id: &str, o: Dict) -> Result<Dict, CallError> {
        self.call("EnsureNetwork", &(id, o)).await
    }

    pub async fn release(&self, id: &str) -> Result<bool, CallError> {
        self.call("ReleaseNetwork", &(id,)).await
    }

    pub async fn get(&self, id: &str) -> Result<Dict, CallError> {
        self.call("GetNetwork", &(id,)).await
    }

    /// GetNetwork's `traffic` (key -> counter).
    /// The agent's `member` signals from now on.
    pub async fn signals(&self, member: &'static str) -> zbus::MessageStream {
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .sender("org.cube.NetworkAgent")
            .unwrap()
            .member(member)
            .unwrap()
            .build();
        zbus::MessageStream::for_match_rule(rule, &self.conn, Some(64))
            .await
            .unwrap()
    }

    pub async fn traffic(&self, id: &str) -> std::collections::BTreeMap<String, u64> {
        let net = self.get(id).await.unwrap();
        let t: HashMap<String, OwnedValue> =
            net["traffic"].try_clone().unwrap().try_into().unwrap();
        t.into_iter()
            .map(|(k, v)| (k, u64::try_from(v).unwrap()))
            .collect()
    }

    pub async fn list(&self) -> Vec<Dict> {
        self.call("ListNetworks", &()).await.unwrap()
    }

    pub async fn reconcile(&self, id: &str) -> Result<Dict, CallError> {
        self.call("ReconcileNetwork", &(id,)).await
    }

    pub async fn health(&self) -> (bool, Vec<(String, bool, String)>) {
        self.call("Health", &()).await.unwrap()
    }

    pub async fn open_tap(&self, id: &str) -> Result<std::os::fd::OwnedFd, CallError> {
        let fd: zbus::zvariant::OwnedFd = self.call("OpenTap", &(id,)).await?;
        Ok(std::os::fd::OwnedFd::from(fd))
    }

    pub async fn property_u32(&self, name: &str) -> u32 {
        let reply = self
            .conn
            .call_method(
                Some(NAME),
                PATH,
                Some("org.freedesktop.DBus.Properties"),
                "Get",
                &(IFACE, name),
            )
            .await
            .unwrap();
        let v: OwnedValue = reply.body().deserialize().unwrap();
        u32::try_from(v).unwrap()
    }

    pub async fn introspect(&self, path: &str) -> String {
        let reply = self
            .conn
            .call_method(
                Some(NAME),
                path,
                Some("org.freedesktop.DBus.Introspectable"),
                "Introspect",
                &(),
            )
            .await
            .unwrap();
        reply.body().deserialize().unwrap()
    }
}

/// TUNGETIFF on a received fd.
/// Pids of the processes holding an fd attached to the TAP `name` (from
/// `/proc/*/fdinfo`, whose `iff:` line names a tun/tap device).
pub fn tap_holders(name: &str) -> Vec<u32> {
    let want = format!("iff:\t{name}");
    let mut pids = vec![];
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fdinfo")) else {
            continue;
        };
        if fds.flatten().any(|fd| {
            std::fs::read_to_string(fd.path()).is_ok_and(|t| t.lines().any(|l| l == want))
        }) {
            pids.push(pid);
        }
    }
    pids
}

pub fn tap_info(fd: &std::os::fd::OwnedFd) -> cube_network_agent::tap::TapFdInfo {
    cube_network_agent::tap::query_fd(fd.as_fd()).unwrap()
}

/// The value size of a pinned map (bpftool).
pub fn pin_value_size(path: &str) -> u64 {
    let out = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned", path])
        .output()
        .expect("bpftool (apt-get install bpftool)");
    assert!(out.status.success(), "bpftool map show pinned {path}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["bytes_value"].as_u64().expect("bytes_value")
}

/// Health's check `name`.
pub fn check<'a>(checks: &'a [(String, bool, String)], name: &str) -> &'a (String, bool, String) {
    checks
        .iter()
        .find(|c| c.0 == name)
        .unwrap_or_else(|| panic!("no {name} check in {checks:?}"))
}

/// Health until `pred` holds (the kernel's notifications arrive
/// asynchronously) within `within`, or panics with the last answer.
pub async fn health_within(
    c: &Client,
    what: &str,
    within: Duration,
    pred: impl Fn(bool, &[(String, bool, String)]) -> bool,
) -> Vec<(String, bool, String)> {
    let deadline = Instant::now() + within;
    loop {
        let (ok, checks) = c.health().await;
        if pred(ok, &checks) {
            return checks;
        }
        assert!(Instant::now() < deadline, "{what}: {ok} {checks:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`health_within`] five seconds.
pub async fn health_until(
    c: &Client,
    what: &str,
    pred: impl Fn(bool, &[(String, bool, String)]) -> bool,
) -> Vec<(String, bool, String)> {
    health_within(c, what, Duration::from_secs(5), pred).await
}

/// `IP_MTU_DISCOVER` of a socket (`libc::IP_PMTUDISC_*`): DO sets DF on
/// every datagram, DONT lets the kernel fragment.
#[allow(dead_code)]
pub fn set_pmtu_discover(s: &impl std::os::fd::AsRawFd, mode: libc::c_int) {
    // SAFETY: setsockopt reads a live c_int of the given size from a
    // socket the caller holds open.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&raw const mode).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(
        rc,
        0,
        "IP_MTU_DISCOVER: {}",
        std::io::Error::last_os_error()
    );
}
