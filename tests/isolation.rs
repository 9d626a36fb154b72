//! Tenant isolation (issue 16), end to end with real packets: nothing a
//! VMM, a guest or a host process does reaches another tenant's traffic.
//! Root only; every test runs the real agent in namespaces of its own.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::ctr::{self, Ctr};
use common::guest::{
    GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, ip6_frame, udp_frame, udp6_datagram,
};
use common::world::{NODE_IP, WORLD_IP, counter, guest_for, in_netns, node};
use common::{Env, mappings, opts, ports, s};
use serde_json::json;
use zbus::zvariant::Value;

const T: Duration = Duration::from_secs(5);

fn ifindex(net: &common::Dict) -> i32 {
    i32::try_from(net["tap_ifindex"].try_clone().unwrap()).unwrap()
}

/// Polls until link `name` is gone (true) or 5 s passed (false).
fn wait_gone(env: &Env, name: &str) -> bool {
    let deadline = std::time::Instant::now() + T;
    while std::time::Instant::now() < deadline {
        if !env.links().contains_key(name) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A VMM that keeps its TAP fd after ReleaseNetwork (slow, hung or
/// hostile) never sees or speaks for the next sandboxes: the handed-out
/// TAP is deleted, never pooled, while new sandboxes cycle through the
/// pool and talk to the world.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tap_a_vmm_still_holds_never_reaches_the_next_sandbox() {
    require_root!();
    let (env, world) = node(&["--warm-pool", "2"]);
    let c = env.client().await;
    let echo = world.udp_echo(5300);
    // A server only the old holder's frames could reach.
    let trap = world.udp_echo(5301);

    let a = c.ensure("vm-a", opts(vec![])).await.unwrap();
    let (tap_a, index_a) = (s(&a, "tap_name"), ifindex(&a));
    let holder = RawGuest::new(c.open_tap("vm-a").await.unwrap());
    assert!(c.release("vm-a").await.unwrap());

    // More sandboxes than the pool holds, released and created again, each
    // with a live guest talking to the world; the holder listens and
    // sends all along.
    let mut live = vec![];
    for i in 0..8 {
        let id = format!("vm-b{i}");
        let (net, g) = guest_for(&c, &id, opts(vec![])).await;
        assert_ne!(s(&net, "tap_name"), tap_a, "{id} got the held TAP");
        assert_ne!(ifindex(&net), index_a, "{id} got the held TAP's device");
        let msg = format!("b{i}");
        assert_eq!(
            g.udp_send_recv(echo, msg.as_bytes(), T).unwrap(),
            format!("world:{msg}").as_bytes()
        );
        let spoof = udp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            SocketAddrV4::new(GUEST_IP, 40000 + i),
            trap,
            format!("holder-{i}").as_bytes(),
        );
        // The write may fail (the device is down or gone): either way
        // nothing may leave.
        let _ = holder.send(&spoof);
        let seen = holder.recv(Duration::from_millis(200));
        assert!(
            seen.is_empty(),
            "the old holder read {} frame(s) while {id} was live",
            seen.len()
        );
        live.push((id, g));
        if i % 2 == 1 {
            let (id, mut g) = live.remove(0);
            g.stop();
            assert!(c.release(&id).await.unwrap());
        }
    }
    assert!(
        world.peers(5301).is_empty(),
        "frames written to the old TAP fd left the node: {:?}",
        world.peers(5301)
    );
    assert!(wait_gone(&env, &tap_a), "{tap_a} was not deleted");
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
}

/// Raises this process's open-file limit to its hard limit (the tests below
/// hold thousands of sockets).
fn raise_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write a live rlimit.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
}

/// A TCP echo server in namespace `ns` on `addr`: every connection gets
/// back what it sends, for as long as it stays open. Returns the peers it
/// accepted, in order.
fn echo_server(ns: &str, addr: SocketAddrV4) -> Arc<Mutex<Vec<SocketAddr>>> {
    let listener = in_netns(ns, move || TcpListener::bind(addr)).unwrap();
    let peers: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
    let seen = peers.clone();
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            if let Ok(p) = s.peer_addr() {
                seen.lock().unwrap().push(p);
            }
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 256];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                })
                .unwrap();
        }
    });
    peers
}

/// `n` TCP connections from namespace `ns` to `dst`, each from `bind` when
/// given (else the kernel's choice).
fn connections(ns: &str, dst: SocketAddrV4, n: usize) -> Vec<TcpStream> {
    in_netns(ns, move || {
        (0..n)
            .map(|i| {
                TcpStream::connect_timeout(&dst.into(), T)
                    .unwrap_or_else(|e| panic!("connection {i} to {dst}: {e}"))
            })
            .collect::<Vec<_>>()
    })
}

/// Which of `conns` no longer echo (reset, or silent for 5 s).
fn broken(conns: &mut [TcpStream], tag: &str) -> Vec<String> {
    let mut bad = vec![];
    for (i, s) in conns.iter_mut().enumerate() {
        let msg = format!("{tag}{i};");
        let mut back = vec![0u8; msg.len()];
        s.set_read_timeout(Some(T)).unwrap();
        let r = s
            .write_all(msg.as_bytes())
            .and_then(|()| s.read_exact(&mut back));
        match r {
            Ok(()) if back == msg.as_bytes() => {}
            Ok(()) => bad.push(format!(
                "{tag}{i}: got {:?}",
                String::from_utf8_lossy(&back)
            )),
            Err(e) => bad.push(format!("{tag}{i} ({:?}): {e}", s.local_addr())),
        }
    }
    bad
}

/// With the default configuration, a sandbox's SNAT flows and the node's
/// own connections to the same server never share a tuple: 1,000
/// established container connections, then 1,000 from the node to the same
/// server and port with ports the kernel picks, then 200 more bound on
/// purpose to the very ports the server saw for sandbox connections (a
/// local process that binds into the SNAT range); every one of the 2,200
/// still works. (With the SNAT range inside the host's ephemeral ports, the
/// node's connect() could pick ports that sandbox flows held, and a host
/// connection on a sandbox flow's tuple took its replies and reset it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_flows_and_the_nodes_own_connections_never_collide() {
    require_root!();
    raise_nofile();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let ctr = Ctr::new("many");
    ctr::add(&env, "many", &ctr, json!({}));
    let server = SocketAddrV4::new(WORLD_IP, 7100);
    let peers = echo_server(&world.ns, server);
    let n = 1000;
    let mut sandbox = connections(&ctr.name, server, n);
    let mut node = connections(&env.ns, server, n);
    let bad = broken(&mut sandbox, "s");
    assert!(
        bad.is_empty(),
        "{} sandbox connections broken: {bad:?}",
        bad.len()
    );
    let bad = broken(&mut node, "n");
    assert!(
        bad.is_empty(),
        "{} node connections broken: {bad:?}",
        bad.len()
    );
    // The sandbox's SNAT ports as the server saw them (the first n peers).
    let taken: Vec<u16> = peers.lock().unwrap()[..n]
        .iter()
        .map(|p| p.port())
        .collect();
    let mut bound: Vec<TcpStream> = taken[..200]
        .iter()
        .map(|&p| {
            let src = SocketAddrV4::new(NODE_IP, p);
            in_netns(&env.ns, move || tcp_from(src, server))
                .unwrap_or_else(|e| panic!("{src} -> {server}: {e}"))
        })
        .collect();
    let bad = broken(&mut bound, "b");
    assert!(
        bad.is_empty(),
        "{} bound node connections broken: {bad:?}",
        bad.len()
    );
    // And after the node's connections: the sandbox's still work.
    let bad = broken(&mut sandbox, "t");
    assert!(
        bad.is_empty(),
        "{} sandbox connections broken: {bad:?}",
        bad.len()
    );
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
    drop(world);
}

/// Every host -> sandbox path gets a guest-side tuple of its own: the
/// host talks to one sandbox service from the same source port over the
/// sandbox IP, 127.0.0.1 and the uplink address at once (interleaved), UDP
/// to a TAP guest and TCP to a container; each exchange gets its own
/// answers. (Before, all three reached the guest as 169.254.68.5:<port>
/// and the later flow took the earlier one's replies.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_paths_from_one_source_port_never_share_a_guest_tuple() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let gw_dev: Ipv4Addr = "192.168.0.1".parse().unwrap();

    // UDP to a TAP guest's echo service.
    let (net, g) = guest_for(
        &c,
        "hp",
        opts(vec![("port_mappings", ports(&[("udp", 5353, 0, "")]))]),
    )
    .await;
    g.udp_echo(5353).unwrap();
    let sandbox_ip: Ipv4Addr = s(&net, "sandbox_ip").parse().unwrap();
    let host_port = mappings(&net)[0].2;
    let paths = [
        (gw_dev, SocketAddrV4::new(sandbox_ip, 5353)),
        (
            Ipv4Addr::LOCALHOST,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, host_port),
        ),
        (NODE_IP, SocketAddrV4::new(NODE_IP, host_port)),
    ];
    let socks: Vec<UdpSocket> = paths
        .iter()
        .map(|(src, _)| {
            let src = SocketAddrV4::new(*src, 40000);
            in_netns(&env.ns, move || UdpSocket::bind(src)).unwrap()
        })
        .collect();
    for round in 0..3 {
        for (i, (sock, (_, dst))) in socks.iter().zip(&paths).enumerate() {
            sock.send_to(format!("udp{i}-{round}").as_bytes(), dst)
                .unwrap();
        }
        for (i, sock) in socks.iter().enumerate() {
            sock.set_read_timeout(Some(T)).unwrap();
            let mut buf = [0u8; 64];
            let (n, _) = sock
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("path {i}, round {round}: {e}"));
            assert_eq!(
                String::from_utf8_lossy(&buf[..n]),
                format!("udp{i}-{round}"),
                "path {i} got another path's answer"
            );
        }
    }

    // TCP to a container's echo service, three connections established at
    // once, then used in turns.
    let ctr = Ctr::new("hp");
    let r = ctr::add(
        &env,
        "hp",
        &ctr,
        json!({"runtimeConfig": {"portMappings": [
            {"hostPort": 20500, "containerPort": 7000, "protocol": "tcp"}]}}),
    );
    let pod: Ipv4Addr = r["ips"][0]["address"]
        .as_str()
        .unwrap()
        .trim_end_matches("/32")
        .parse()
        .unwrap();
    echo_server(&ctr.name, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7000));
    let paths = [
        (gw_dev, SocketAddrV4::new(pod, 7000)),
        (
            Ipv4Addr::LOCALHOST,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, 20500),
        ),
        (NODE_IP, SocketAddrV4::new(NODE_IP, 20500)),
    ];
    let mut conns: Vec<TcpStream> = paths
        .iter()
        .map(|(src, dst)| {
            let (src, dst) = (SocketAddrV4::new(*src, 40001), *dst);
            in_netns(&env.ns, move || tcp_from(src, dst))
                .unwrap_or_else(|e| panic!("{src} -> {dst}: {e}"))
        })
        .collect();
    for round in 0..3 {
        for (i, s) in conns.iter_mut().enumerate() {
            s.write_all(format!("tcp{i}-{round};").as_bytes()).unwrap();
        }
        for (i, s) in conns.iter_mut().enumerate() {
            let want = format!("tcp{i}-{round};");
            let mut back = vec![0u8; want.len()];
            s.set_read_timeout(Some(T)).unwrap();
            s.read_exact(&mut back)
                .unwrap_or_else(|e| panic!("path {i}, round {round}: {e}"));
            assert_eq!(String::from_utf8_lossy(&back), want);
        }
    }
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
    drop(world);
}

/// A TCP connection from `src` (bound explicitly, SO_REUSEADDR) to `dst`;
/// runs in the caller's namespace.
fn tcp_from(src: SocketAddrV4, dst: SocketAddrV4) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: socket(2) with constant arguments; the fd is checked, then
    // owned by the TcpStream.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    let sa = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let (s, d) = (sa(src), sa(dst));
    // SAFETY: setsockopt reads a live c_int; bind and connect read a
    // sockaddr_in of the size passed.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
        if libc::bind(fd, (&s as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&d as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(stream)
}

/// Replies fragmented on the way reach the sandbox whole (the fragments
/// after the first follow it: they carry no ports), for a SNAT flow and a
/// port mapping, and the node answers no fragment with an ICMP error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragmented_replies_reach_the_sandbox() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    // The world's link is narrower: it fragments what it sends.
    world.run(|| {
        assert!(
            std::process::Command::new("ip")
                .args(["link", "set", "w0", "mtu", "1200"])
                .status()
                .unwrap()
                .success()
        )
    });
    let ctr = Ctr::new("frag");
    ctr::add(
        &env,
        "frag",
        &ctr,
        json!({"runtimeConfig": {"portMappings": [
            {"hostPort": 20600, "containerPort": 7300, "protocol": "udp"}]}}),
    );
    let big: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();

    // SNAT: the container asks, the world answers with 4,000 bytes (four
    // fragments) on a socket connected to the node's SNAT address, which
    // would report an ICMP error the node sent back.
    let server = SocketAddrV4::new(WORLD_IP, 7200);
    let w = in_netns(&world.ns, move || UdpSocket::bind(server)).unwrap();
    let csock = in_netns(&ctr.name, || UdpSocket::bind("0.0.0.0:0")).unwrap();
    csock.set_read_timeout(Some(T)).unwrap();
    csock.send_to(b"big?", server).unwrap();
    w.set_read_timeout(Some(T)).unwrap();
    let mut buf = vec![0u8; 8192];
    let (_, from) = w.recv_from(&mut buf).unwrap();
    w.connect(from).unwrap();
    w.send(&big).unwrap();
    let (n, _) = csock.recv_from(&mut buf).expect("the fragmented reply");
    assert_eq!(&buf[..n], &big[..], "the reply arrived whole");
    std::thread::sleep(Duration::from_millis(300));
    w.set_nonblocking(true).unwrap();
    let e = w.recv(&mut buf).unwrap_err();
    assert_eq!(
        e.kind(),
        std::io::ErrorKind::WouldBlock,
        "the world got an ICMP error: {e}"
    );

    // A port mapping: 4,000 bytes from the world to node:20600.
    let inbound = in_netns(&ctr.name, || UdpSocket::bind("0.0.0.0:7300")).unwrap();
    inbound.set_read_timeout(Some(T)).unwrap();
    let wc = in_netns(&world.ns, || UdpSocket::bind("0.0.0.0:0")).unwrap();
    wc.send_to(&big, SocketAddrV4::new(NODE_IP, 20600)).unwrap();
    let (n, _) = inbound
        .recv_from(&mut buf)
        .expect("the fragmented datagram");
    assert_eq!(&buf[..n], &big[..]);

    let (_, checks) = c.health().await;
    assert!(counter(&checks, "frag") >= 6, "{checks:?}");
    drop(world);
}

/// A sandbox MTU above the uplink's is refused: its full-size packets could
/// not leave the node, and nothing would tell the guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtu_above_the_uplinks_is_refused() {
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let e = c
        .ensure("big", opts(vec![("mtu", Value::from(1600u32))]))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.InvalidArgument");
    assert!(
        e.message.contains("mtu") && e.message.contains("1500"),
        "{}",
        e.message
    );
    assert!(c.list().await.is_empty());
    c.ensure("ok", opts(vec![("mtu", Value::from(1500u32))]))
        .await
        .unwrap();
}

// ---------------------------------------------------------------------
// Only the node itself reaches a sandbox (issue 25).

/// Connects to `dst` from namespace `ns` (as `uid`, or root) and reads
/// what the guest's listener says first; `Ok(banner)` or the error.
fn connect_as(ns: &str, uid: Option<u32>, dst: SocketAddrV4) -> Result<String, String> {
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", ns]);
    if let Some(uid) = uid {
        cmd.arg("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg("--clear-groups");
    }
    // Debian's interpreter (any uid may run it), not a per-user one.
    let out = cmd
        .args([
            "/usr/bin/python3",
            "-c",
            "import socket,sys\n\
             try:\n\
             \ts=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=2)\n\
             \ts.settimeout(2)\n\
             \tprint(s.recv(64).decode())\n\
             except OSError as e:\n\
             \tprint('no connection:', e)\n\
             \tsys.exit(3)",
        ])
        .arg(dst.ip().to_string())
        .arg(dst.port().to_string())
        .output()
        .expect("/usr/bin/python3");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    match out.status.code() {
        Some(0) => Ok(text),
        // The connection failed (the only failure that counts).
        Some(3) => Err(text),
        _ => panic!(
            "the client did not run as {uid:?}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// A plain container on the node (veth, its own address, the node as its
/// router, as Docker sets one up), deleted on drop with its namespace.
fn docker_like_container(env: &Env, tag: &str) -> Ctr {
    let ctr = Ctr::new(tag);
    let host_if = format!("dk{}", std::process::id() % 100_000);
    env.ns_cmd(&[
        "ip", "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ctr.name,
    ]);
    env.ns_cmd(&["ip", "addr", "add", "10.123.0.1/24", "dev", &host_if]);
    env.ns_cmd(&["ip", "link", "set", &host_if, "up"]);
    for args in [
        vec!["addr", "add", "10.123.0.2/24", "dev", "eth0"],
        vec!["link", "set", "eth0", "up"],
        vec!["link", "set", "lo", "up"],
        vec!["route", "add", "default", "via", "10.123.0.1"],
    ] {
        let ok = std::process::Command::new("ip")
            .args(["-n", &ctr.name])
            .args(&args)
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip {args:?} in the container");
    }
    ctr
}

/// A sandbox's address answers the node's own root processes only: not
/// an unprivileged local user, not a container the node forwards for,
/// not a host on the uplink's network with a route to the pool. A port
/// mapping stays open to every local user, and the operator can grant a
/// uid host access. A port of root's that another user takes over after
/// its socket closed gives that user nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_node_itself_reaches_a_sandbox() {
    require_root!();
    let (mut env, world) = node(&[]);
    // Forwarding on, as on every Docker or Kubernetes node.
    env.ns_cmd(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    let c = env.client().await;
    let (net, g) = guest_for(
        &c,
        "ha",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    let sandbox = SocketAddrV4::new(s(&net, "sandbox_ip").parse().unwrap(), 80);
    let mapped = SocketAddrV4::new(Ipv4Addr::LOCALHOST, mappings(&net)[0].2);
    assert_eq!(
        connect_as(&env.ns, None, sandbox),
        Ok("guest:80".into()),
        "root"
    );
    assert!(
        connect_as(&env.ns, Some(65534), sandbox).is_err(),
        "an unprivileged local user reached the sandbox's address"
    );
    assert_eq!(
        connect_as(&env.ns, Some(65534), mapped),
        Ok("guest:80".into()),
        "a port mapping is open to local users"
    );
    let ctr = docker_like_container(&env, "ha");
    assert!(
        connect_as(&ctr.name, None, sandbox).is_err(),
        "a container the node forwards for reached the sandbox"
    );
    let ok = std::process::Command::new("ip")
        .args([
            "-n",
            &world.ns,
            "route",
            "add",
            "192.168.0.0/18",
            "via",
            "198.51.100.1",
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok, "a route to the pool in the world");
    assert!(
        connect_as(&world.ns, None, sandbox).is_err(),
        "a host on the uplink's network reached the sandbox"
    );
    let checks = c.health().await.1;
    assert!(
        counter(&checks, "forwarded_to_sandbox_drop") > 0,
        "{checks:?}"
    );
    assert!(counter(&checks, "host_access_denied") > 0, "{checks:?}");
    // Root again, and the guest's own flows to its gateway: unaffected.
    assert_eq!(connect_as(&env.ns, None, sandbox), Ok("guest:80".into()));
    // A UDP socket of root's to the sandbox that closes, its port taken
    // over by another user at once: the flow's entry is no grant.
    g.udp_echo(5353).unwrap();
    let echo = SocketAddrV4::new(*sandbox.ip(), 5353);
    let port = in_netns(&env.ns, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.send_to(b"root", echo).unwrap();
        let mut b = [0u8; 16];
        let n = s.recv(&mut b).expect("root's echo");
        assert_eq!(&b[..n], b"root");
        s.local_addr().unwrap().port()
    });
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &env.ns,
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .args([
            "/usr/bin/python3",
            "-c",
            "import socket,sys\n\
             s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             s.bind(('0.0.0.0', int(sys.argv[3]))); s.settimeout(2)\n\
             s.sendto(b'nobody', (sys.argv[1], int(sys.argv[2])))\n\
             try:\n\
             \tprint(s.recv(64))\n\
             except OSError as e:\n\
             \tprint('no answer:', e); sys.exit(3)",
        ])
        .arg(echo.ip().to_string())
        .arg("5353")
        .arg(port.to_string())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "root's former port gave uid 65534 the sandbox: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Granted by the operator: uid 4242 may (65534, the uid of packets
    // without a socket, is refused as a grant).
    drop(c);
    env.kill_agent();
    env.set_args(&["--host-access-uids", "65534"]);
    assert!(env.try_start_agent().is_err(), "65534 granted");
    env.set_args(&["--host-access-uids", "4242"]);
    env.start_agent();
    assert_eq!(
        connect_as(&env.ns, Some(4242), sandbox),
        Ok("guest:80".into()),
        "a granted uid"
    );
    assert!(
        connect_as(&env.ns, Some(4243), sandbox).is_err(),
        "another uid"
    );
    assert!(connect_as(&env.ns, Some(65534), sandbox).is_err(), "nobody");
}

/// One sandbox sending datagrams to its gateway from tens of thousands of
/// ports (each twice) holds at most its share of the host-flow table: the
/// node's flows to another sandbox's mapped ports keep their entries (a
/// datagram the guest sends first after the flood still reaches the node's
/// socket: with the entries evicted it went to the gateway address
/// instead), a TCP connection keeps working, and a new one opens. Then the
/// same from a third sandbox flooding over IPv6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_flow_flood_never_resets_another_sandboxs_connection() {
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let (net, victim) = guest_for(
        &c,
        "victim",
        opts(vec![(
            "port_mappings",
            ports(&[("tcp", 7000, 0, ""), ("udp", 5353, 0, "")]),
        )]),
    )
    .await;
    victim.tcp_echo(7000).unwrap();
    victim.udp_echo(5353).unwrap();
    let m = mappings(&net);
    let port_of = |p: &str| m.iter().find(|x| x.0 == p).unwrap().2;
    let mapped = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port_of("tcp"));
    let mapped_udp = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port_of("udp"));
    let exchange = |s: &mut TcpStream, m: &[u8]| -> Result<(), String> {
        s.write_all(m).map_err(|e| e.to_string())?;
        let mut back = vec![0u8; m.len()];
        s.set_read_timeout(Some(T)).unwrap();
        s.read_exact(&mut back).map_err(|e| e.to_string())?;
        (back == m).then_some(()).ok_or("another answer".into())
    };
    let mut live = in_netns(&env.ns, move || TcpStream::connect(mapped)).unwrap();
    exchange(&mut live, b"before").unwrap();
    // A UDP flow of the node's to the mapped port, from a port of its own.
    let local = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 41_000);
    let udp = in_netns(&env.ns, move || UdpSocket::bind(local)).unwrap();
    udp.set_read_timeout(Some(T)).unwrap();
    udp.send_to(b"hello", mapped_udp).unwrap();
    let mut buf = [0u8; 64];
    let (n, _) = udp.recv_from(&mut buf).expect("the echo");
    assert_eq!(&buf[..n], b"hello");

    let (_, flood) = guest_for(&c, "flood", opts(vec![])).await;
    let gw = Ipv4Addr::new(169, 254, 68, 5);
    for p in 0..70_000u32 {
        let src = SocketAddrV4::new(GUEST_IP, 1024 + (p % 64_000) as u16);
        let dst = SocketAddrV4::new(gw, 9 + (p / 64_000) as u16);
        let f = udp_frame(GUEST_MAC, GATEWAY_MAC, src, dst, b"x");
        flood.send_raw_frame(&f).unwrap();
        flood.send_raw_frame(&f).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The guest speaks first on the node's UDP flow: its entries are there.
    let late = udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        SocketAddrV4::new(GUEST_IP, 5353),
        SocketAddrV4::new(gw, local.port()),
        b"late",
    );
    victim.send_raw_frame(&late).unwrap();
    let (n, from) = udp
        .recv_from(&mut buf)
        .expect("the guest's datagram on the node's flow after the flood");
    assert_eq!(
        (&buf[..n], from),
        (&b"late"[..], SocketAddr::V4(mapped_udp))
    );
    exchange(&mut live, b"after the flood").expect("the live connection");
    let mut fresh = in_netns(&env.ns, move || TcpStream::connect(mapped)).unwrap();
    exchange(&mut fresh, b"a new one").expect("a new connection");
    let checks = c.health().await.1;
    let full = counter(&checks, "host_flow_share_full");
    assert!(full > 0, "the flood hit its share: {checks:?}");

    // The same from a sandbox that floods over IPv6 (to fd63:7562:6500::5,
    // from ::6): the host-flow table and its shares are both families'.
    let (_, flood6) = guest_for(&c, "flood6", opts(vec![])).await;
    let gw6: Ipv6Addr = "fd63:7562:6500::5".parse().unwrap();
    let me6: Ipv6Addr = "fd63:7562:6500::6".parse().unwrap();
    for p in 0..70_000u32 {
        let d = udp6_datagram(1024 + (p % 64_000) as u16, 9 + (p / 64_000) as u16, b"x");
        let f = ip6_frame(GUEST_MAC, GATEWAY_MAC, me6, gw6, 17, 64, &d);
        flood6.send_raw_frame(&f).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    exchange(&mut live, b"after the IPv6 flood").expect("the live connection");
    let mut fresh = in_netns(&env.ns, move || TcpStream::connect(mapped)).unwrap();
    exchange(&mut fresh, b"a new one after it").expect("a new connection");
    let t = c.traffic("flood6").await;
    assert!(
        t["new_flows_host_ipv6"] > 0
            && t["drop_no_port_ipv6"] > 0
            && t["drop_no_port"] == t["drop_no_port_ipv6"],
        "its IPv6 flows opened, then stopped at its share: {t:?}"
    );
    let checks = c.health().await.1;
    assert!(
        counter(&checks, "host_flow_share_full") > full,
        "{checks:?}"
    );
}

/// Flows others open to a sandbox come from a budget of their own (issue
/// 44, item 4): a local process flooding a sandbox's UDP mapping on lo
/// from 5,000 source ports (each a host flow) fills that budget only, and
/// the guest's own queries to its resolver are all answered (before: the
/// flood took the sandbox's whole share, and 0 of 5 were).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_flood_through_a_mapping_leaves_the_guest_its_own_flows() {
    require_root!();
    let (env, _world) = node(&["--dns-upstream", "198.51.100.2"]);
    let c = env.client().await;
    let (net, victim) = guest_for(
        &c,
        "victim",
        opts(vec![
            ("port_mappings", ports(&[("udp", 5353, 0, "")])),
            // Offline: its resolver answers every name REFUSED at once.
            ("allow_internet_access", Value::from(false)),
        ]),
    )
    .await;
    let mapped = SocketAddrV4::new(Ipv4Addr::LOCALHOST, mappings(&net)[0].2);
    let full0 = counter(&c.health().await.1, "host_flow_share_full");
    in_netns(&env.ns, move || {
        for p in 0..5_000u16 {
            let s = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 30_000 + p)).unwrap();
            s.send_to(b"x", mapped).unwrap();
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        counter(&c.health().await.1, "host_flow_share_full") > full0,
        "the flood reached its budget's end"
    );
    let resolver = SocketAddrV4::new(Ipv4Addr::new(169, 254, 68, 5), 53);
    let q =
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x04test\x00\x00\x01\x00\x01";
    let answered = (0..5)
        .filter(|_| victim.udp_send_recv(resolver, q, T).is_ok())
        .count();
    assert_eq!(answered, 5, "the guest's own queries after the flood");
}

/// What the node sends to a sandbox's address fits the sandbox's link:
/// the route to the pool carries the default sandbox MTU, so the node's
/// TCP advertises a matching MSS and a datagram too large with DF set
/// fails at the sender (EMSGSIZE) instead of vanishing on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_packets_fit_the_sandbox_mtu() {
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let (net, g) = guest_for(&c, "mtu", opts(vec![])).await;
    g.tcp_listen(80).unwrap();
    let ip: Ipv4Addr = s(&net, "sandbox_ip").parse().unwrap();
    let route = env.ns_cmd(&["ip", "route", "get", &ip.to_string()]);
    assert!(route.contains("mtu 1300"), "{route}");
    let mss = in_netns(&env.ns, move || {
        use std::os::fd::AsRawFd;
        let s = TcpStream::connect(SocketAddrV4::new(ip, 80)).unwrap();
        let mut v: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a live c_int.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_MAXSEG,
                (&raw mut v).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        v
    });
    assert!(mss <= 1260, "MSS {mss}");
    let sent = in_netns(&env.ns, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        common::set_pmtu_discover(&s, libc::IP_PMTUDISC_DO);
        s.send_to(&[0u8; 1400], SocketAddrV4::new(ip, 5353))
    });
    let e = sent.expect_err("1400 bytes with DF to a 1300-byte link");
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE), "{e}");
}
