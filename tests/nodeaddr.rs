//! The node's own addresses and the sandboxes' identities, end to end
//! (issue 51 item 3, issue 44 items 2 and 3): a sandbox's packets to the
//! node never leave by the uplink (whether IPv4 forwarding is on or off),
//! a port mapping at the node's address is reached by hairpin, and no
//! packet with a sandbox identity as its source enters the node except
//! through the datapath: not from the uplink, not from a local user with
//! IP_FREEBIND / IPV6_FREEBIND (no capability needed). Root only; every
//! test runs the real agent in namespaces of its own.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::Duration;

use common::guest::{
    GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, parse_ipv4, udp_frame,
};
use common::world::{Capture, NODE_IP, Server, counter, guest_for, node};
use common::{opts, ports, s};

const T: Duration = Duration::from_millis(1500);

fn sysctl(ns: &str, key: &str, value: &str) {
    let ok = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "sysctl",
            "-qw",
            &format!("{key}={value}"),
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok, "sysctl {key}={value} in {ns}");
}

async fn datapath_counter(c: &common::Client, name: &str) -> u64 {
    counter(&c.health().await.1, name)
}

/// A sandbox's TCP and UDP to the node's uplink address, the gateway
/// device's address, loopback and another sandbox's address are dropped
/// and counted, with forwarding off (before: SNATed and sent to the
/// uplink's next hop) and on (before: routed by the node); nothing of them
/// reaches the far side of the uplink (a capture there). A port mapping at
/// the node's address answers by hairpin, and node services stay reachable
/// at the gateway, 169.254.68.5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_traffic_to_the_node_never_leaves_by_the_uplink() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let _tcp = Server::tcp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 2222),
        b"node:",
    );
    let _udp = Server::udp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 5353),
        b"node:",
    );
    let (net_b, b) = guest_for(
        &c,
        "target",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 20090, "")]))]),
    )
    .await;
    b.tcp_listen(80).unwrap();
    let target_ip: Ipv4Addr = s(&net_b, "sandbox_ip").parse().unwrap();
    let (_, a) = guest_for(&c, "caller", opts(vec![])).await;
    let cap = Capture::start(
        &world,
        &env.dir,
        "ip and (dst host 198.51.100.1 or dst net 192.168.0.0/16 or dst net 127.0.0.0/8)",
    );
    let (drops0, hairpin0) = (
        datapath_counter(&c, "node_addr_drop").await,
        datapath_counter(&c, "hairpin").await,
    );
    let gwdev = Ipv4Addr::new(192, 168, 0, 1);
    for forwarding in ["0", "1"] {
        sysctl(&env.ns, "net.ipv4.ip_forward", forwarding);
        let got = a
            .tcp_connect_send_recv(SocketAddrV4::new(NODE_IP, 20090), b"hi", T * 2)
            .unwrap_or_else(|e| panic!("hairpin (forwarding {forwarding}): {e}"));
        assert!(
            got.starts_with(b"guest:80"),
            "{}",
            String::from_utf8_lossy(&got)
        );
        for dst in [
            SocketAddrV4::new(NODE_IP, 2222),
            SocketAddrV4::new(gwdev, 2222),
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, 2222),
            SocketAddrV4::new(target_ip, 80),
            // A mapped port, but not at the uplink's address.
            SocketAddrV4::new(gwdev, 20090),
        ] {
            let r = a.tcp_connect_send_recv(dst, b"hi", T);
            assert!(r.is_err(), "{dst} (forwarding {forwarding}): {r:?}");
        }
        let r = a.udp_send_recv(SocketAddrV4::new(NODE_IP, 5353), b"hi", T);
        assert!(
            r.is_err(),
            "udp to the node (forwarding {forwarding}): {r:?}"
        );
        // The node's services are at the gateway.
        let got = a
            .tcp_connect_send_recv(SocketAddrV4::new(GATEWAY_IP, 2222), b"hi", T * 2)
            .unwrap_or_else(|e| panic!("the node at the gateway: {e}"));
        assert_eq!(got, b"node:hi");
    }
    let leaked = cap.stop();
    assert!(
        leaked.trim().is_empty(),
        "packets for the node reached the far side of the uplink:\n{leaked}"
    );
    let drops = datapath_counter(&c, "node_addr_drop").await - drops0;
    assert!(drops >= 12, "node_addr_drop went up by {drops}");
    assert!(datapath_counter(&c, "hairpin").await > hairpin0);
}

/// Runs python3 `script` with `args` in namespace `ns`, as `uid` (65534:
/// an ordinary local user) or root; its stdout.
fn py(ns: &str, uid: Option<u32>, script: &str, args: &[&str]) -> String {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]);
    if let Some(u) = uid {
        cmd.args([
            "setpriv",
            &format!("--reuid={u}"),
            &format!("--regid={u}"),
            "--clear-groups",
        ]);
    }
    let out = cmd
        .args(["/usr/bin/python3", "-c", script])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 in {ns} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A DNS question from `src` (bound with IP_FREEBIND / IPV6_FREEBIND, which
/// need no capability; "" = any) to `dst`:53: "ANSWER" or "NONE".
const FORGE_DNS: &str = r#"
import socket, sys
src, dst = sys.argv[1], sys.argv[2]
fam = socket.AF_INET6 if ':' in dst else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
if fam == socket.AF_INET6:
    s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
else:
    s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND
s.bind((src, 0))
s.settimeout(1.5)
q = b'\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x04test\x00\x00\x01\x00\x01'
try:
    s.sendto(q, (dst, 53))
    s.recv(512)
    print("ANSWER")
except OSError:  # a timeout, or the kernel refusing the route (IPv4)
    print("NONE")
"#;

/// A TCP connection from `src` (FREEBIND) to `dst` port `port`: "CONNECTED"
/// or "NONE".
const FORGE_TCP: &str = r#"
import socket, sys
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ':' in dst else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM)
if fam == socket.AF_INET6:
    s.setsockopt(socket.IPPROTO_IPV6, 78, 1)
else:
    s.setsockopt(socket.IPPROTO_IP, 15, 1)
s.bind((src, 0))
s.settimeout(1.5)
try:
    s.connect((dst, port))
    print("CONNECTED")
except OSError:
    print("NONE")
"#;

/// An ICMP echo request from `src` to `dst` with payload `data`, built
/// whole (IP_HDRINCL: what a host on the uplink can send).
const FORGE_PING: &str = r#"
import socket, struct, sys
src, dst, data = sys.argv[1], sys.argv[2], sys.argv[3].encode()
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return (~s) & 0xffff
icmp = struct.pack('!BBHHH', 8, 0, 0, 0x4242, 1) + data
icmp = icmp[:2] + struct.pack('!H', csum(icmp)) + icmp[4:]
ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(icmp), 7, 0, 64, 1, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for _ in range(3):
    s.sendto(ip + icmp, (dst, 0))
"#;

/// A TCP SYN-ACK from `src` (a node address) to `dst`:`port`, as the
/// kernel sends for a connection someone forged.
const SYN_ACK: &str = r#"
import socket, struct, sys
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return (~s) & 0xffff
tcp = struct.pack('!HHIIBBHHH', 22, port, 1000, 2000, 5 << 4, 0x12, 65535, 0, 0)
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack('!BBH', 0, 6, len(tcp))
tcp = tcp[:16] + struct.pack('!H', csum(pseudo + tcp)) + tcp[18:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
s.bind((src, 0))
for _ in range(3):
    s.sendto(tcp, (dst, 0))
"#;

/// No sandbox identity enters the node but through the datapath. A local
/// user (uid 65534) sending from a sandbox's IPv4 or IPv6 identity with
/// FREEBIND reaches neither the agent's resolver nor a root listener
/// (before: the resolver took it for the sandbox, over IPv6); from its own
/// address it is answered (the check can fail). A host on the uplink
/// pinging the node "from" a sandbox gets no echo reply into the sandbox
/// (before: the node's reply, with the forger's payload, was delivered).
/// A SYN-ACK the node sends to a sandbox for a connection it never opened
/// opens no host flow and is not delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_sandbox_sources_never_enter_the_node() {
    require_root!();
    let (env, world) = node(&["--dns-upstream", "198.51.100.2"]);
    let c = env.client().await;
    let net = c
        .ensure(
            "victim",
            opts(vec![(
                "allow_internet_access",
                zbus::zvariant::Value::from(false),
            )]),
        )
        .await
        .unwrap();
    let raw = RawGuest::new(c.open_tap("victim").await.unwrap());
    let ip = s(&net, "sandbox_ip");
    let ip6 = s(&net, "sandbox_ipv6");
    assert!(!ip6.is_empty(), "the sandbox has an IPv6 identity: {ip6}");
    // The gateway device's IPv6: ipv6_pool with the device's IPv4 address.
    let mut o = ip6.parse::<std::net::Ipv6Addr>().unwrap().octets();
    o[12..].copy_from_slice(&[192, 168, 0, 1]);
    let gwdev6 = std::net::Ipv6Addr::from(o).to_string();
    let forged0 = datapath_counter(&c, "forged_source_drop").await;
    // The resolver's answer to a forged source goes to the sandbox, not to
    // the forger: what counts is whether it took the query as the
    // sandbox's. An offline sandbox's every query is refused and counted
    // (dns_refused) with its name.
    let refused = async || c.traffic("victim").await["dns_refused"];
    // The control: the same user from its own address is answered
    // (REFUSED: a stranger).
    assert_eq!(
        py(&env.ns, Some(65534), FORGE_DNS, &["0.0.0.0", "192.168.0.1"]),
        "ANSWER"
    );
    assert_eq!(
        py(&env.ns, Some(65534), FORGE_DNS, &["::", &gwdev6]),
        "ANSWER"
    );
    for (src, dst) in [(&ip, "192.168.0.1"), (&ip6, gwdev6.as_str())] {
        for _ in 0..3 {
            py(&env.ns, Some(65534), FORGE_DNS, &[src, dst]);
        }
    }
    assert_eq!(
        refused().await,
        0,
        "a local user's query was taken for the sandbox's"
    );
    // The sandbox's own query is (the check can fail).
    let q =
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x04test\x00\x00\x01\x00\x01";
    raw.send(&udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        SocketAddrV4::new(GUEST_IP, 40000),
        SocketAddrV4::new(GATEWAY_IP, 53),
        q,
    ))
    .unwrap();
    let deadline = std::time::Instant::now() + T;
    while refused().await == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(refused().await, 1, "the sandbox's own query");
    // A local user connecting "from" the sandbox to a root listener: the
    // node's SYN-ACK would go to the sandbox as root's new flow.
    let _root = Server::tcp(
        &env.ns,
        "[::]:2223".parse::<std::net::SocketAddr>().unwrap(),
        b"",
    );
    raw.recv(Duration::from_millis(200));
    for (src, dst) in [(&ip, "192.168.0.1"), (&ip6, gwdev6.as_str())] {
        assert_eq!(
            py(&env.ns, Some(65534), FORGE_TCP, &[src, dst, "2223"]),
            "NONE"
        );
    }
    let tcp: Vec<_> = raw
        .recv(T)
        .into_iter()
        .filter(|f| {
            f.len() > 54
                && ((f[12..14] == [0x86, 0xdd] && f[20] == 6)
                    || (f[12..14] == [8, 0] && f[23] == 6))
        })
        .collect();
    assert!(
        tcp.is_empty(),
        "the node answered the forger into the sandbox: {tcp:?}"
    );
    // From the uplink: an echo request "from" the sandbox.
    raw.recv(Duration::from_millis(200));
    py(
        &world.ns,
        None,
        FORGE_PING,
        &[&ip, &NODE_IP.to_string(), "INJECTED-PAYLOAD"],
    );
    let got = raw.recv(T);
    let leaked: Vec<_> = got
        .iter()
        .filter(|f| f.windows(16).any(|w| w == b"INJECTED-PAYLOAD"))
        .collect();
    assert!(
        leaked.is_empty(),
        "the forger's payload reached the sandbox"
    );
    assert!(datapath_counter(&c, "forged_source_drop").await >= forged0 + 5);
    // The kernel's SYN-ACK for a connection the sandbox never opened.
    let not_opening0 = datapath_counter(&c, "host_not_opening_drop").await;
    py(&env.ns, None, SYN_ACK, &["192.168.0.1", &ip, "80"]);
    let got = raw.recv(T);
    let tcp: Vec<_> = got
        .iter()
        .filter(|f| parse_ipv4(f).is_some_and(|(_, d, p, _)| d == GUEST_IP && p == 6))
        .collect();
    assert!(tcp.is_empty(), "a SYN-ACK reached the sandbox: {tcp:?}");
    assert!(datapath_counter(&c, "host_not_opening_drop").await >= not_opening0 + 3);
}
