//! The host-facing surface of the datapath (issue "Safe host-facing
//! surface"), with real packets: a port mapping's `host_ip` scopes it, a
//! host socket wins over a mapping, a host connection never shares a tuple
//! with a SNAT flow,
//! SNAT ports come from `snat_port_range` only, replies of inbound flows
//! are not subject to the sandbox's egress policy, and a failed attach
//! leaves the previous datapath state in force. Root only.

mod common;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpStream, UdpSocket};
use std::os::fd::FromRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData};
use cube_network_agent::datapath::maps::{
    DP_F_INTERNET, DpPolicyData, DpPortmapKey, DpPortmapVal, DpSandbox, DpTap, SANDBOX_MAP_ENTRIES,
};
use zbus::zvariant::Value;

use common::world::{self, NODE_IP, World, counter, guest_for, node};
use common::{Env, mappings, opts, ports, s};

const T: Duration = Duration::from_secs(5);
/// How long a negative check waits for an answer that must not come.
const NO: Duration = Duration::from_millis(700);
const LOCALHOST: Ipv4Addr = Ipv4Addr::LOCALHOST;

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// TCP exchange from namespace `ns` (the node: "the host"; or the world).
fn tcp(ns: &str, dst: SocketAddrV4, timeout: Duration) -> Result<Vec<u8>, String> {
    world::tcp_exchange_in(ns, dst, b"x", timeout)
}

/// UDP exchange from a fresh socket in namespace `ns`.
fn udp(ns: &str, dst: SocketAddrV4, timeout: Duration) -> Result<Vec<u8>, String> {
    world::udp_exchange_in(ns, dst, b"q", timeout)
}

/// A UDP socket created in `ns` (it stays there), bound to `local`.
fn udp_socket_in(ns: &str, local: SocketAddrV4) -> UdpSocket {
    world::in_netns(ns, move || UdpSocket::bind(local))
        .unwrap_or_else(|e| panic!("bind udp {local} in {ns}: {e}"))
}

/// One datagram exchange on an existing socket (the same 5-tuple every
/// time), re-sent every 250 ms.
fn udp_on(
    sock: &UdpSocket,
    dst: SocketAddrV4,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 2048];
    loop {
        sock.send_to(payload, dst)
            .map_err(|e| format!("send to {dst}: {e}"))?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(250));
        if wait.is_zero() {
            return Err(format!("udp {dst}: no reply"));
        }
        sock.set_read_timeout(Some(wait)).unwrap();
        if let Ok((n, _)) = sock.recv_from(&mut buf) {
            return Ok(buf[..n].to_vec());
        }
    }
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

/// TCP from `local` (an explicit source address and port) to `dst` inside
/// namespace `ns`: connect, send, half-close, read to EOF.
fn tcp_from(
    ns: &str,
    local: SocketAddrV4,
    dst: SocketAddrV4,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    world::in_netns(ns, move || {
        // SAFETY: socket(2) with constant arguments; the fd is checked and
        // then owned by the TcpStream below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh socket nobody else owns.
        let stream = unsafe { TcpStream::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        // SAFETY: setsockopt reads a live c_int of the size passed.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                (&one as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let sa = sockaddr(local);
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: bind reads a valid sockaddr_in of the size passed.
        if unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), len) } != 0 {
            return Err(format!("bind {local}: {}", std::io::Error::last_os_error()));
        }
        // SO_SNDTIMEO bounds a blocking connect(2) on Linux.
        stream.set_write_timeout(Some(timeout)).unwrap();
        let da = sockaddr(dst);
        // SAFETY: connect reads a valid sockaddr_in of the size passed.
        if unsafe { libc::connect(fd, (&da as *const libc::sockaddr_in).cast(), len) } != 0 {
            return Err(format!(
                "connect {local} -> {dst}: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut s = stream;
        s.write_all(b"h").map_err(|e| format!("write: {e}"))?;
        s.shutdown(Shutdown::Write)
            .map_err(|e| format!("shutdown: {e}"))?;
        s.set_read_timeout(Some(timeout)).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .map_err(|e| format!("read from {dst} after {out:?}: {e}"))?;
        Ok(out)
    })
}

// ---------------------------------------------------------------------------

/// host_ip scopes a mapping: 127.0.0.1 only from the host itself, a node
/// address only as the packet's destination, 0.0.0.0/"" on the uplink
/// address (world and host) and 127/8 (host) — never on another address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_ip_scopes_port_mappings() {
    require_root!();
    let (env, world) = node(&[]);
    // A node address that is not the uplink's, routed to the node by the world.
    env.ns_cmd(&["ip", "addr", "add", "10.77.0.1/32", "dev", "lo"]);
    let ok = std::process::Command::new("ip")
        .args([
            "-n",
            &world.ns,
            "route",
            "add",
            "10.77.0.1/32",
            "via",
            "198.51.100.1",
        ])
        .status()
        .unwrap();
    assert!(ok.success());
    let other = Ipv4Addr::new(10, 77, 0, 1);
    let c = env.client().await;
    let (net, g) = guest_for(
        &c,
        "scope",
        opts(vec![(
            "port_mappings",
            ports(&[
                ("tcp", 80, 21001, "127.0.0.1"),
                ("udp", 53, 21002, "127.0.0.1"),
                ("tcp", 80, 21003, "198.51.100.1"),
                ("udp", 53, 21004, "198.51.100.1"),
                ("tcp", 80, 21005, ""),
                ("udp", 53, 21006, "0.0.0.0"),
                ("tcp", 80, 21007, "10.77.0.1"),
            ]),
        )]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    g.udp_echo(53).unwrap();
    // "" is echoed as the default bind address.
    let echoed: Vec<String> = mappings(&net).into_iter().map(|m| m.3).collect();
    assert_eq!(echoed[4], "0.0.0.0", "{echoed:?}");
    let (h, w) = (env.ns.as_str(), world.ns.as_str());
    let banner = b"guest:80".to_vec();

    // 127.0.0.1: the host's own connections to exactly 127.0.0.1, nothing else.
    assert_eq!(tcp(h, at(LOCALHOST, 21001), T).unwrap(), banner);
    assert_eq!(udp(h, at(LOCALHOST, 21002), T).unwrap(), b"q");
    assert!(
        tcp(w, at(NODE_IP, 21001), NO).is_err(),
        "loopback mapping reached from the world"
    );
    assert!(
        udp(w, at(NODE_IP, 21002), NO).is_err(),
        "loopback mapping reached from the world"
    );
    assert!(
        tcp(h, at(NODE_IP, 21001), NO).is_err(),
        "loopback mapping on the uplink address"
    );
    assert!(tcp(h, at(Ipv4Addr::new(127, 0, 0, 2), 21001), NO).is_err());
    assert!(udp(h, at(NODE_IP, 21002), NO).is_err());

    // The uplink address: world and host, only as that destination.
    assert_eq!(tcp(w, at(NODE_IP, 21003), T).unwrap(), banner);
    assert_eq!(udp(w, at(NODE_IP, 21004), T).unwrap(), b"q");
    assert_eq!(tcp(h, at(NODE_IP, 21003), T).unwrap(), banner);
    assert!(tcp(h, at(LOCALHOST, 21003), NO).is_err());
    assert!(udp(h, at(LOCALHOST, 21004), NO).is_err());

    // Wildcard: uplink address (world, host) and loopback (host).
    assert_eq!(tcp(w, at(NODE_IP, 21005), T).unwrap(), banner);
    assert_eq!(tcp(h, at(NODE_IP, 21005), T).unwrap(), banner);
    assert_eq!(tcp(h, at(LOCALHOST, 21005), T).unwrap(), banner);
    assert_eq!(udp(w, at(NODE_IP, 21006), T).unwrap(), b"q");
    assert_eq!(udp(h, at(LOCALHOST, 21006), T).unwrap(), b"q");
    // ... but not on another address, whoever sends to it.
    assert!(
        tcp(w, at(other, 21005), NO).is_err(),
        "wildcard captured 10.77.0.1 from the world"
    );
    assert!(
        tcp(h, at(other, 21005), NO).is_err(),
        "wildcard captured 10.77.0.1 from the host"
    );
    assert!(udp(w, at(other, 21006), NO).is_err());

    // A specific node address: only as the destination (from the host).
    assert_eq!(tcp(h, at(other, 21007), T).unwrap(), banner);
    assert!(tcp(h, at(LOCALHOST, 21007), NO).is_err());
    assert!(tcp(h, at(NODE_IP, 21007), NO).is_err());
    assert!(tcp(w, at(NODE_IP, 21007), NO).is_err());
}

/// A host socket on a mapped port wins for new flows, TCP and UDP, from
/// the world and from the host; a mapped flow already running keeps going;
/// the mapping serves again once the host socket is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_sockets_win_over_port_mappings() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (_, g) = guest_for(
        &c,
        "taken",
        opts(vec![(
            "port_mappings",
            ports(&[("tcp", 80, 22001, ""), ("udp", 53, 22002, "")]),
        )]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    g.udp_echo(53).unwrap();
    let (h, w) = (env.ns.as_str(), world.ns.as_str());
    assert_eq!(tcp(w, at(NODE_IP, 22001), T).unwrap(), b"guest:80");
    // A mapped UDP flow that stays up (same world socket throughout).
    let running = udp_socket_in(w, at(Ipv4Addr::UNSPECIFIED, 0));
    assert_eq!(
        udp_on(&running, at(NODE_IP, 22002), b"u1", T).unwrap(),
        b"u1"
    );

    // The host starts services on both ports (sshd started later, say).
    let host_tcp = world::Server::tcp(h, at(Ipv4Addr::UNSPECIFIED, 22001), b"host:");
    let host_udp = world::Server::udp(h, at(Ipv4Addr::UNSPECIFIED, 22002), b"host:");
    assert_eq!(tcp(w, at(NODE_IP, 22001), T).unwrap(), b"host:x");
    assert_eq!(tcp(h, at(NODE_IP, 22001), T).unwrap(), b"host:x");
    assert_eq!(tcp(h, at(LOCALHOST, 22001), T).unwrap(), b"host:x");
    assert_eq!(udp(w, at(NODE_IP, 22002), T).unwrap(), b"host:q");
    assert_eq!(udp(h, at(LOCALHOST, 22002), T).unwrap(), b"host:q");
    // The mapped flow that was already running still reaches the guest.
    assert_eq!(
        udp_on(&running, at(NODE_IP, 22002), b"u2", T).unwrap(),
        b"u2"
    );
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "portmap_host_socket") >= 5, "{checks:?}");

    // The host lets go: the mapping serves new flows again.
    drop((host_tcp, host_udp));
    assert_eq!(tcp(w, at(NODE_IP, 22001), T).unwrap(), b"guest:80");
    assert_eq!(tcp(h, at(LOCALHOST, 22001), T).unwrap(), b"guest:80");
    assert_eq!(udp(w, at(NODE_IP, 22002), T).unwrap(), b"q");
}

/// SNAT ports come from snat_port_range only, and a host connection that
/// would use the tuple of a live sandbox flow leaves with another port
/// instead (to_uplink): the sandbox gets exactly its replies, the host
/// exactly its own; a closed sandbox flow gives its tuple to the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snat_uses_its_range_only_and_host_connections_never_share_a_tuple() {
    require_root!();
    let (env, world) = node(&["--snat-port-range", "61000-61007"]);
    let c = env.client().await;
    let (_, g) = guest_for(&c, "snat", opts(vec![])).await;
    // The remote end of the sandbox's flow: a socket of this test in the
    // world, so it can answer each side on its own.
    let remote = at(world::WORLD_IP, 5601);
    let w = udp_socket_in(&world.ns, remote);
    w.set_read_timeout(Some(T)).unwrap();
    std::thread::scope(|scope| {
        // The guest sends and waits for an answer on its flow.
        let guest = scope.spawn(|| g.udp_send_recv(remote, b"g", Duration::from_secs(10)));
        let mut buf = [0u8; 64];
        let (n, from) = w.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"g");
        let sandbox_port = from.port();
        assert!(
            (61000..=61007).contains(&sandbox_port),
            "SNAT port from the range: {from}"
        );
        // A host socket bound to that very port (explicitly: the range is
        // outside the host's ephemeral ports) talks to the same remote.
        let mine = udp_socket_in(&env.ns, at(NODE_IP, sandbox_port));
        mine.send_to(b"h", remote).unwrap();
        let (n, host_from) = w.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"h");
        assert_ne!(
            host_from.port(),
            sandbox_port,
            "the host connection left with another port"
        );
        assert!((61000..=61007).contains(&host_from.port()), "{host_from}");
        // Each side gets its own answer, and only its own.
        w.send_to(b"for-host", host_from).unwrap();
        mine.set_read_timeout(Some(T)).unwrap();
        let (n, _) = mine.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"for-host", "the host got its reply on its port");
        w.send_to(b"for-guest", from).unwrap();
        assert_eq!(guest.join().unwrap().unwrap(), b"for-guest");
        mine.set_read_timeout(Some(NO)).unwrap();
        assert!(
            mine.recv_from(&mut buf).is_err(),
            "the sandbox's reply reached the host socket on its port"
        );
    });

    // TCP: the sandbox's flow to world:5700 (refused: RST, closed) holds a
    // port; a host connection from that port to the same remote takes the
    // closed tuple as it is.
    let tcp_dst = World::world_addr(5700);
    assert!(
        g.tcp_connect_send_recv(tcp_dst, b"g", Duration::from_secs(2))
            .is_err()
    );
    world.tcp_server(5700);
    // Whichever port the closed flow held: every port of the range serves
    // a host connection to that remote.
    for p in 61000..=61007 {
        assert_eq!(
            tcp_from(&env.ns, at(NODE_IP, p), tcp_dst, T).unwrap(),
            b"world:h",
            "host TCP from port {p}"
        );
    }

    let (_, checks) = c.health().await;
    assert!(counter(&checks, "host_remap") >= 1, "{checks:?}");
}

/// With allow_internet_access=false, flows that come in (through a port
/// mapping from the world or the host, or to the sandbox IP) work both
/// ways; a new outbound flow is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_flows_work_without_internet_access() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (net, g) = guest_for(
        &c,
        "closed",
        opts(vec![
            ("allow_internet_access", Value::from(false)),
            (
                "port_mappings",
                ports(&[("tcp", 80, 23001, ""), ("udp", 53, 23002, "")]),
            ),
        ]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    g.udp_echo(53).unwrap();
    let (h, w) = (env.ns.as_str(), world.ns.as_str());
    assert_eq!(tcp(w, at(NODE_IP, 23001), T).unwrap(), b"guest:80");
    assert_eq!(udp(w, at(NODE_IP, 23002), T).unwrap(), b"q");
    assert_eq!(tcp(h, at(LOCALHOST, 23001), T).unwrap(), b"guest:80");
    assert_eq!(udp(h, at(LOCALHOST, 23002), T).unwrap(), b"q");
    let ip: Ipv4Addr = s(&net, "sandbox_ip").parse().unwrap();
    assert_eq!(tcp(h, at(ip, 80), T).unwrap(), b"guest:80");

    // New outbound flows are still dropped, TCP and UDP.
    let (_, before) = c.health().await;
    let tcp_dst = world.tcp_server(9494);
    let udp_dst = world.udp_echo(5454);
    assert!(
        g.tcp_connect_send_recv(tcp_dst, b"x", Duration::from_secs(1))
            .is_err()
    );
    assert!(
        g.udp_send_recv(udp_dst, b"x", Duration::from_secs(1))
            .is_err()
    );
    assert!(world.peers(9494).is_empty() && world.peers(5454).is_empty());
    let (_, after) = c.health().await;
    assert!(
        counter(&after, "policy_drop") >= counter(&before, "policy_drop") + 2,
        "{after:?}"
    );
}

// ---------------------------------------------------------------------------
// Transactional attach

fn pinned(env: &Env, name: &str) -> MapData {
    MapData::from_pin(Path::new(&env.dir).join("bpf").join(name)).unwrap()
}

fn policy_map(env: &Env, name: &str) -> LpmTrie<MapData, DpPolicyData, u8> {
    LpmTrie::try_from(Map::LpmTrie(pinned(env, name))).unwrap()
}

fn ip_be(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// Filler entries of made-up sandboxes 10.254.x.y until `name` holds
/// capacity minus one entries.
fn fill_to_one_short(env: &Env, name: &str) {
    let mut m = policy_map(env, name);
    let have = m.keys().count() as u32;
    for i in 0..(SANDBOX_MAP_ENTRIES - 1 - have) {
        let sbx = Ipv4Addr::new(10, 254, (i >> 8) as u8, i as u8);
        let k = Key::new(
            64,
            DpPolicyData {
                sandbox_ip: ip_be(sbx),
                dst: i,
            },
        );
        m.insert(&k, 1, 0).unwrap();
    }
    assert_eq!(m.keys().count() as u32, SANDBOX_MAP_ENTRIES - 1);
}

/// (prefix length, destination) of every policy key of `ip` in `name`.
fn policy_of(env: &Env, name: &str, ip: Ipv4Addr) -> HashSet<(u32, Ipv4Addr)> {
    policy_map(env, name)
        .keys()
        .map(Result::unwrap)
        .filter(|k| k.data().sandbox_ip == ip_be(ip))
        .map(|k| {
            (
                k.prefix_len() - 32,
                Ipv4Addr::from(k.data().dst.to_ne_bytes()),
            )
        })
        .collect()
}

/// Sandbox IPs owning policy keys in `name`, filler excluded.
fn policy_owners(env: &Env, name: &str) -> HashSet<Ipv4Addr> {
    policy_map(env, name)
        .keys()
        .map(|k| Ipv4Addr::from(k.unwrap().data().sandbox_ip.to_ne_bytes()))
        .filter(|ip| ip.octets()[..2] != [10, 254])
        .collect()
}

/// Every port-map entry as (host ip, host port, sandbox ip).
fn portmap_entries(env: &Env) -> HashSet<(Ipv4Addr, u16, Ipv4Addr)> {
    let m: HashMap<MapData, DpPortmapKey, DpPortmapVal> =
        HashMap::try_from(Map::HashMap(pinned(env, "portmap"))).unwrap();
    m.iter()
        .map(Result::unwrap)
        .map(|(k, v)| {
            (
                Ipv4Addr::from(k.host_ip.to_ne_bytes()),
                u16::from_be(k.host_port),
                Ipv4Addr::from(v.sandbox_ip.to_ne_bytes()),
            )
        })
        .collect()
}

fn cidr(a: [u8; 4], len: u32) -> (u32, Ipv4Addr) {
    (len, Ipv4Addr::from(a))
}

/// The datapath's flags of the network's sandbox entry.
fn sandbox_flags(env: &Env, net: &common::Dict) -> u32 {
    let sandboxes: HashMap<MapData, u32, DpSandbox> =
        HashMap::try_from(Map::HashMap(pinned(env, "sandboxes"))).unwrap();
    let ifindex = i32::try_from(net["tap_ifindex"].try_clone().unwrap()).unwrap() as u32;
    sandboxes.get(&ifindex, 0).unwrap().flags
}

/// A converge that fails part-way (a full policy_deny map) leaves the
/// network's previous entries in force; an EnsureNetwork that fails
/// (a full policy_allow map) leaves no entry of the new sandbox behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attach_leaves_the_previous_state() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (net, g) = guest_for(
        &c,
        "old",
        opts(vec![
            ("allow_out", Value::from(vec!["10.1.0.0/16".to_string()])),
            ("deny_out", Value::from(vec!["10.2.0.0/16".to_string()])),
            ("port_mappings", ports(&[("tcp", 80, 24001, "")])),
        ]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    let ip: Ipv4Addr = s(&net, "sandbox_ip").parse().unwrap();
    let w = world.ns.as_str();
    assert_eq!(tcp(w, at(NODE_IP, 24001), T).unwrap(), b"guest:80");
    let allow_before = policy_of(&env, "policy_allow", ip);
    let deny_before = policy_of(&env, "policy_deny", ip);
    assert_eq!(allow_before, HashSet::from([cidr([10, 1, 0, 0], 16)]));
    assert_eq!(deny_before, HashSet::from([cidr([10, 2, 0, 0], 16)]));
    let ports_before = portmap_entries(&env);
    assert_eq!(
        ports_before,
        HashSet::from([(Ipv4Addr::UNSPECIFIED, 24001, ip)])
    );

    let flags_before = sandbox_flags(&env, &net);

    // Converge: two new allow keys (fit), two new deny keys (the second
    // does not), a new mapping, no internet. It fails, and every entry
    // written so far is taken back.
    fill_to_one_short(&env, "policy_deny");
    let e = c
        .ensure(
            "old",
            opts(vec![
                ("allow_internet_access", Value::from(false)),
                (
                    "allow_out",
                    Value::from(vec!["10.3.0.0/16".to_string(), "10.4.0.0/16".to_string()]),
                ),
                (
                    "deny_out",
                    Value::from(vec!["10.5.0.0/16".to_string(), "10.6.0.0/16".to_string()]),
                ),
                ("port_mappings", ports(&[("tcp", 80, 24002, "")])),
            ]),
        )
        .await
        .expect_err("the deny map is full");
    assert!(
        e.message.contains("policy_deny") && e.message.contains("full"),
        "{e:?}"
    );
    assert_eq!(policy_of(&env, "policy_allow", ip), allow_before);
    assert_eq!(policy_of(&env, "policy_deny", ip), deny_before);
    assert_eq!(portmap_entries(&env), ports_before);
    assert_eq!(sandbox_flags(&env, &net), flags_before, "the entry kept");
    assert_ne!(flags_before & DP_F_INTERNET, 0, "internet access kept");
    // And the packets agree: the old mapping serves, the new one does not,
    // the guest still reaches the world.
    assert_eq!(tcp(w, at(NODE_IP, 24001), T).unwrap(), b"guest:80");
    assert!(tcp(w, at(NODE_IP, 24002), NO).is_err());
    let world_tcp = world.tcp_server(9595);
    assert_eq!(
        g.tcp_connect_send_recv(world_tcp, b"o", T).unwrap(),
        b"world:o"
    );
    assert_eq!(mappings(&c.get("old").await.unwrap())[0].2, 24001);

    // A new sandbox whose second allow_out key does not fit: refused, and
    // none of its entries stays behind.
    fill_to_one_short(&env, "policy_allow");
    let e = c
        .ensure(
            "new",
            opts(vec![
                (
                    "allow_out",
                    Value::from(vec!["10.7.0.0/16".to_string(), "10.8.0.0/16".to_string()]),
                ),
                ("port_mappings", ports(&[("tcp", 80, 24003, "")])),
            ]),
        )
        .await
        .expect_err("the allow map is full");
    assert!(
        e.message.contains("policy_allow") && e.message.contains("full"),
        "{e:?}"
    );
    assert_eq!(policy_owners(&env, "policy_allow"), HashSet::from([ip]));
    assert_eq!(policy_owners(&env, "policy_deny"), HashSet::from([ip]));
    assert_eq!(portmap_entries(&env), ports_before);
    let by_ip: HashMap<MapData, u32, DpTap> =
        HashMap::try_from(Map::HashMap(pinned(&env, "by_ip"))).unwrap();
    let owners: HashSet<u32> = by_ip.keys().map(Result::unwrap).collect();
    assert_eq!(owners, HashSet::from([ip_be(ip)]));
    assert!(c.get("new").await.is_err());
    assert!(tcp(w, at(NODE_IP, 24003), NO).is_err());
}
