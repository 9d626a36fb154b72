//! The "node + world" topology for datapath tests, and helpers to run code
//! inside a network namespace.
//!
//! ```text
//!   agent's netns (env.ns)                    world netns (<env.ns>-w)
//!   up0 198.51.100.1/24  <---- veth ---->  w0 198.51.100.2/24
//!   default route via 198.51.100.2             servers: World::tcp_server / udp_echo
//! ```
//!
//! `Env::new` starts the agent at once, before any uplink exists, so the
//! agent finds no default route. Either create the world and restart the
//! agent ([`World::attach_and_restart`]: kill -9 + start; the agent adopts
//! its state, TAPs and networks on restart, which is itself part of the
//! contract), or call [`World::attach`] and restart it yourself when the
//! test wants to do something between the two.
//!
//! Servers are sockets created on a short-lived thread that `setns`es into
//! the namespace (a socket stays in the namespace it was created in), then
//! served from an ordinary thread. The protocol is "read to EOF (or 2 s of
//! silence), answer `<prefix>` + what was read, close": clients half-close
//! after sending, which `Guest::tcp_connect_send_recv` does by default.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Env;

pub const UPLINK: &str = "up0";
pub const WORLD_IF: &str = "w0";
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const WORLD_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const PREFIX_LEN: u8 = 24;
/// IPv6 on the same link ([`World::add_ipv6`]): the node's global
/// address (what NAT66 sends from) and the world's.
pub const NODE_IP6: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0x2001, 0xdb8, 0xc0be, 0, 0, 0, 0, 1);
pub const WORLD_IP6: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0x2001, 0xdb8, 0xc0be, 0, 0, 0, 0, 2);

type Peers = Arc<Mutex<Vec<SocketAddr>>>;

/// How long a server waits for more bytes before answering anyway.
const SERVER_READ_TIMEOUT: Duration = Duration::from_secs(2);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a fresh thread whose network namespace is the named one
/// (`ip netns` name), and returns its result. Sockets created inside stay
/// in that namespace wherever they are used afterwards.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    let handle = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        // SAFETY: setns(2) on a valid netns fd we hold open; it only changes
        // this (fresh, single-purpose) thread's network namespace.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    });
    match handle.join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Connect to `addr`, write `payload`, half-close, read until EOF.
pub fn tcp_exchange(
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let addr: SocketAddr = addr.into();
    let deadline = Instant::now() + timeout;
    let mut s =
        TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect {addr}: {e}"))?;
    let left = |d: Instant| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left(deadline))).unwrap();
    s.write_all(payload)
        .map_err(|e| format!("write to {addr}: {e}"))?;
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown to {addr}: {e}"))?;
    let mut out = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        s.set_read_timeout(Some(left(deadline))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => {
                return Err(format!(
                    "read from {addr} after {} bytes ({:?}): {e}",
                    out.len(),
                    String::from_utf8_lossy(&out)
                ));
            }
        }
    }
}

/// Send one datagram from an ephemeral port and wait for one back
/// (re-sent every 250 ms).
pub fn udp_exchange(
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let addr: SocketAddr = addr.into();
    let any = if addr.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let s = UdpSocket::bind(any).map_err(|e| format!("udp bind: {e}"))?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 65536];
    loop {
        s.send_to(payload, addr)
            .map_err(|e| format!("udp send to {addr}: {e}"))?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(250));
        if wait.is_zero() {
            return Err(format!("udp {addr}: no reply"));
        }
        s.set_read_timeout(Some(wait)).unwrap();
        match s.recv_from(&mut buf) {
            Ok((n, _)) => return Ok(buf[..n].to_vec()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(format!("udp recv from {addr}: {e}")),
        }
    }
}

/// [`tcp_exchange`] from inside the namespace `ns`.
pub fn tcp_exchange_in(
    ns: &str,
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let addr: SocketAddr = addr.into();
    let payload = payload.to_vec();
    in_netns(ns, move || tcp_exchange(addr, &payload, timeout))
}

/// [`udp_exchange`] from inside the namespace `ns`.
pub fn udp_exchange_in(
    ns: &str,
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let addr: SocketAddr = addr.into();
    let payload = payload.to_vec();
    in_netns(ns, move || udp_exchange(addr, &payload, timeout))
}

/// A TCP or UDP server in some namespace. Replies `prefix` + request; keeps
/// a log of the peers it served. Stops on Drop.
pub struct Server {
    pub addr: SocketAddr,
    peers: Peers,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// A TCP server on `addr` in namespace `ns`: reads to EOF (or 2 s of
    /// silence), answers `prefix` + what it read, closes.
    pub fn tcp(ns: &str, addr: impl Into<SocketAddr>, prefix: &[u8]) -> Server {
        let addr: SocketAddr = addr.into();
        let listener = in_netns(ns, move || TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("bind tcp {addr} in {ns}: {e}"));
        listener.set_nonblocking(true).unwrap();
        let local = listener.local_addr().unwrap();
        let (peers, stop): (Peers, _) = (Arc::default(), Arc::new(AtomicBool::new(false)));
        let (p, st, prefix) = (Arc::clone(&peers), Arc::clone(&stop), prefix.to_vec());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, peer)) => {
                        p.lock().unwrap().push(peer);
                        let prefix = prefix.clone();
                        std::thread::spawn(move || serve_tcp(conn, &prefix));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => {
                        eprintln!("tcp server {local}: accept: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        });
        Server {
            addr: local,
            peers,
            stop,
            thread: Some(thread),
        }
    }

    /// A UDP server on `addr` in namespace `ns`: answers every datagram
    /// with `prefix` + its payload.
    pub fn udp(ns: &str, addr: impl Into<SocketAddr>, prefix: &[u8]) -> Server {
        let addr: SocketAddr = addr.into();
        let sock = in_netns(ns, move || UdpSocket::bind(addr))
            .unwrap_or_else(|e| panic!("bind udp {addr} in {ns}: {e}"));
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let local = sock.local_addr().unwrap();
        let (peers, stop): (Peers, _) = (Arc::default(), Arc::new(AtomicBool::new(false)));
        let (p, st, prefix) = (Arc::clone(&peers), Arc::clone(&stop), prefix.to_vec());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while !st.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = sock.recv_from(&mut buf) {
                    p.lock().unwrap().push(peer);
                    let mut out = prefix.clone();
                    out.extend_from_slice(&buf[..n]);
                    let _ = sock.send_to(&out, peer);
                }
            }
        });
        Server {
            addr: local,
            peers,
            stop,
            thread: Some(thread),
        }
    }

    /// Peers served so far (for SNAT checks: who did the server see?).
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().unwrap().clone()
    }
}

fn serve_tcp(mut conn: TcpStream, prefix: &[u8]) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(SERVER_READ_TIMEOUT));
    let mut got = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let mut out = prefix.to_vec();
    out.extend_from_slice(&got);
    let _ = conn.write_all(&out);
    let _ = conn.shutdown(Shutdown::Both);
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The world namespace next to an agent's namespace. Dropping it stops its
/// servers and deletes the namespace (which deletes the veth pair).
pub struct World {
    /// The world's namespace, `<node_ns>-w`.
    pub ns: String,
    /// The agent's ("node") namespace.
    pub node_ns: String,
    servers: Mutex<Vec<Server>>,
}

impl World {
    /// Creates the world next to `node_ns`: veth `up0` (198.51.100.1/24,
    /// node side) ↔ `w0` (198.51.100.2/24, world side) and a default route
    /// in the node namespace via 198.51.100.2.
    pub fn create(node_ns: &str) -> World {
        let ns = format!("{node_ns}-w");
        let _ = Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(Stdio::null())
            .status();
        ip(&["netns", "add", &ns]);
        // From here on Drop cleans up, even if a later step panics.
        let world = World {
            ns: ns.clone(),
            node_ns: node_ns.into(),
            servers: Mutex::new(Vec::new()),
        };
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n", node_ns, "link", "add", UPLINK, "type", "veth", "peer", "name", WORLD_IF,
            "netns", &ns,
        ]);
        let node_cidr = format!("{NODE_IP}/{PREFIX_LEN}");
        let world_cidr = format!("{WORLD_IP}/{PREFIX_LEN}");
        ip(&["-n", node_ns, "addr", "add", &node_cidr, "dev", UPLINK]);
        ip(&["-n", &ns, "addr", "add", &world_cidr, "dev", WORLD_IF]);
        ip(&["-n", node_ns, "link", "set", UPLINK, "up"]);
        ip(&["-n", &ns, "link", "set", WORLD_IF, "up"]);
        ip(&[
            "-n",
            node_ns,
            "route",
            "replace",
            "default",
            "via",
            &WORLD_IP.to_string(),
            "dev",
            UPLINK,
        ]);
        world
    }

    /// IPv6 on the uplink: `NODE_IP6`/64 on up0 and `WORLD_IP6`/64 on w0
    /// (no duplicate address detection: usable at once), the node's IPv6
    /// default route via the world, and the world's extra `more`
    /// addresses (/128 on w0: hosts the node routes to the world). The
    /// agent sees it after a restart.
    pub fn add_ipv6(&self, more: &[std::net::Ipv6Addr]) {
        let node6 = format!("{NODE_IP6}/64");
        let world6 = format!("{WORLD_IP6}/64");
        ip(&[
            "-n",
            &self.node_ns,
            "addr",
            "add",
            &node6,
            "dev",
            UPLINK,
            "nodad",
        ]);
        ip(&[
            "-n", &self.ns, "addr", "add", &world6, "dev", WORLD_IF, "nodad",
        ]);
        for a in more {
            let a = format!("{a}/128");
            ip(&["-n", &self.ns, "addr", "add", &a, "dev", WORLD_IF, "nodad"]);
        }
        ip(&[
            "-n",
            &self.node_ns,
            "-6",
            "route",
            "replace",
            "default",
            "via",
            &WORLD_IP6.to_string(),
            "dev",
            UPLINK,
        ]);
    }

    /// [`World::create`] next to `env`'s namespace. The running agent does
    /// not see the new uplink until it is restarted.
    pub fn attach(env: &Env) -> World {
        World::create(&env.ns)
    }

    /// [`World::attach`], then kill -9 and restart the agent so that its
    /// uplink detection finds `up0`.
    pub fn attach_and_restart(env: &mut Env) -> World {
        let world = World::attach(env);
        env.kill_agent();
        env.start_agent();
        world
    }

    pub fn node_addr(port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(NODE_IP, port)
    }

    pub fn world_addr(port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(WORLD_IP, port)
    }

    /// A TCP server on 0.0.0.0:`port` in the world answering
    /// `b"world:"` + request. Returns the address to reach it at
    /// (198.51.100.2:`port`).
    pub fn tcp_server(&self, port: u16) -> SocketAddrV4 {
        let s = Server::tcp(
            &self.ns,
            SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port),
            b"world:",
        );
        let port = s.addr.port();
        self.servers.lock().unwrap().push(s);
        World::world_addr(port)
    }

    /// A UDP server on 0.0.0.0:`port` in the world answering
    /// `b"world:"` + datagram.
    pub fn udp_echo(&self, port: u16) -> SocketAddrV4 {
        let s = Server::udp(
            &self.ns,
            SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port),
            b"world:",
        );
        let port = s.addr.port();
        self.servers.lock().unwrap().push(s);
        World::world_addr(port)
    }

    /// [`World::tcp_server`] on [::]:`port` (every world address, IPv6
    /// and IPv4).
    pub fn tcp_server6(&self, port: u16) -> u16 {
        let any6 = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), port);
        let s = Server::tcp(&self.ns, any6, b"world:");
        let port = s.addr.port();
        self.servers.lock().unwrap().push(s);
        port
    }

    /// [`World::udp_echo`] on [::]:`port`.
    pub fn udp_echo6(&self, port: u16) -> u16 {
        let any6 = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), port);
        let s = Server::udp(&self.ns, any6, b"world:");
        let port = s.addr.port();
        self.servers.lock().unwrap().push(s);
        port
    }

    /// Peers seen by the world's server(s) on `port` (TCP and UDP).
    pub fn peers(&self, port: u16) -> Vec<SocketAddr> {
        self.servers
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.addr.port() == port)
            .flat_map(|s| s.peers())
            .collect()
    }

    /// TCP from the world (e.g. to `198.51.100.1:host_port`).
    pub fn tcp_connect(
        &self,
        addr: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        tcp_exchange_in(&self.ns, addr, payload, timeout)
    }

    /// UDP from the world.
    pub fn udp_send_recv(
        &self,
        addr: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        udp_exchange_in(&self.ns, addr, payload, timeout)
    }

    /// Runs `f` inside the world namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        in_netns(&self.ns, f)
    }

    /// Runs `f` inside the agent's ("node") namespace, e.g. host → sandbox
    /// IP or host → 127.0.0.1:host_port connections.
    pub fn on_node<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        in_netns(&self.node_ns, f)
    }

    /// Deletes the world (also done by Drop).
    pub fn cleanup(&mut self) {
        self.servers.lock().unwrap().clear();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.ns])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// An agent whose uplink is up0 (198.51.100.1) facing a world namespace.
pub fn node(args: &[&str]) -> (super::Env, World) {
    let mut env = super::Env::new(args);
    let world = World::attach_and_restart(&mut env);
    (env, world)
}

/// Ensures `id` with options `o` and starts a smoltcp guest on its TAP.
pub async fn guest_for(
    c: &super::Client,
    id: &str,
    o: super::Dict,
) -> (super::Dict, super::guest::Guest) {
    let net = c.ensure(id, o).await.unwrap();
    let fd = c.open_tap(id).await.unwrap();
    (net, super::guest::Guest::start_default(fd))
}

/// A datapath drop/forward counter from Health's `datapath` check.
pub fn counter(checks: &[(String, bool, String)], name: &str) -> u64 {
    let detail = &checks.iter().find(|c| c.0 == "datapath").unwrap().2;
    detail
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// tcpdump on the world's end of the uplink (`w0`), packets the world
/// receives only, with a capture `filter`: what reached the far side of the
/// uplink.
pub struct Capture {
    child: std::process::Child,
    out: std::path::PathBuf,
}

impl Capture {
    pub fn start(world: &World, dir: &std::path::Path, filter: &str) -> Capture {
        static CAPTURES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let tag = CAPTURES.fetch_add(1, Ordering::Relaxed);
        let (out, err) = (
            dir.join(format!("w0-{tag}.txt")),
            dir.join(format!("w0-{tag}.err")),
        );
        let child = Command::new("ip")
            .args([
                "netns", "exec", &world.ns, "tcpdump", "-l", "-n", "-Q", "in", "-i",
            ])
            .arg(WORLD_IF)
            .arg(filter)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("tcpdump (scripts/deps.sh)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("listening on")
        {
            assert!(Instant::now() < deadline, "tcpdump did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Capture { child, out }
    }

    /// Stops it and returns what it printed (a line a packet).
    pub fn stop(mut self) -> String {
        std::thread::sleep(Duration::from_millis(300));
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
