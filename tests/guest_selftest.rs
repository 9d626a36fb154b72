//! Self-tests of the datapath test harness (tests/common/guest.rs and
//! tests/common/world.rs), independent of the eBPF datapath: the guests
//! talk to the kernel through a TAP we create ourselves, configured as the
//! gateway (169.254.68.5/30, MAC 20:90:6f:cf:cf:cf) in a throwaway
//! namespace; the world topology is checked next to a real agent. Root only.

mod common;

use std::net::{IpAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::Env;
use common::guest::{
    ARP_REPLY, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC, Guest, GuestConfig, RawGuest,
    arp_request, mac_str, parse_arp,
};
use common::world::{self, NODE_IP, Server, UPLINK, WORLD_IP, World, in_netns};

const T: Duration = Duration::from_secs(2);

/// A namespace holding one TAP that plays the gateway for a guest.
struct KernelTap {
    ns: String,
    fd: OwnedFd,
}

const TAP: &str = "gtap0";

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl KernelTap {
    fn new() -> KernelTap {
        static N: AtomicU32 = AtomicU32::new(0);
        let ns = format!(
            "cngt-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &ns]);
        let guard = NsGuard(ns.clone());
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        let fd = in_netns(&ns, || {
            let tap = cube_network_agent::tap::Tap::create(TAP).map_err(|e| e.to_string())?;
            tap.dup().map_err(|e| e.to_string())
        })
        .expect("creating the TAP");
        let gw_mac = mac_str(&GATEWAY_MAC);
        ip(&[
            "-n", &ns, "link", "set", TAP, "address", &gw_mac, "mtu", "1300",
        ]);
        ip(&["-n", &ns, "addr", "add", "169.254.68.5/30", "dev", TAP]);
        ip(&["-n", &ns, "link", "set", TAP, "up"]);
        std::mem::forget(guard);
        KernelTap { ns, fd }
    }

    fn fd(&self) -> OwnedFd {
        self.fd.try_clone().unwrap()
    }

    fn guest(&self) -> Guest {
        Guest::start(self.fd(), GuestConfig::default())
    }
}

/// Deletes a namespace on drop (deleting it deletes the TAP too).
struct NsGuard(String);

impl Drop for NsGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for KernelTap {
    fn drop(&mut self) {
        drop(NsGuard(self.ns.clone()));
    }
}

#[test]
fn guest_pings_the_kernel_gateway() {
    require_root!();
    let k = KernelTap::new();
    let g = k.guest();
    let rtt = g.ping(GATEWAY_IP, T).unwrap();
    assert!(rtt < T, "{rtt:?}");
    // A second ping finds the neighbour resolved.
    g.ping(GATEWAY_IP, T).unwrap();
    // Nobody answers for an address the gateway has no route to.
    assert!(
        g.ping("203.0.113.9".parse().unwrap(), Duration::from_millis(300))
            .is_err()
    );
}

#[test]
fn guest_tcp_and_udp_to_kernel_servers() {
    require_root!();
    let k = KernelTap::new();
    let tcp = Server::tcp(&k.ns, SocketAddrV4::new(GATEWAY_IP, 8080), b"node:");
    let udp = Server::udp(&k.ns, SocketAddrV4::new(GATEWAY_IP, 5353), b"node:");
    let g = k.guest();
    let dst = SocketAddrV4::new(GATEWAY_IP, 8080);
    assert_eq!(
        g.tcp_connect_send_recv(dst, b"hello", T).unwrap(),
        b"node:hello"
    );
    // Random source ports: two connections in a row both work and differ.
    assert_eq!(
        g.tcp_connect_send_recv(dst, b"again", T).unwrap(),
        b"node:again"
    );
    let peers = tcp.peers();
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert!(
        peers.iter().all(|p| p.ip() == IpAddr::V4(GUEST_IP)),
        "{peers:?}"
    );
    assert_ne!(peers[0].port(), peers[1].port());

    let (reply, from) = g
        .udp_send_recv_from(SocketAddrV4::new(GATEWAY_IP, 5353), b"dgram", T)
        .unwrap();
    assert_eq!(reply, b"node:dgram");
    assert_eq!(from, SocketAddrV4::new(GATEWAY_IP, 5353));
    assert_eq!(udp.peers()[0].ip(), IpAddr::V4(GUEST_IP));

    // A closed port is refused (RST), quickly.
    let err = g
        .tcp_connect_send_recv(SocketAddrV4::new(GATEWAY_IP, 1), b"x", T)
        .unwrap_err();
    assert!(err.contains("refused"), "{err}");
}

#[test]
fn guest_services_are_reachable_from_the_namespace() {
    require_root!();
    let k = KernelTap::new();
    let g = k.guest();
    g.tcp_listen(80).unwrap();
    g.tcp_listen(8443).unwrap();
    g.udp_echo(7).unwrap();
    for _ in 0..3 {
        let got =
            world::tcp_exchange_in(&k.ns, SocketAddrV4::new(GUEST_IP, 80), b"GET /", T).unwrap();
        assert_eq!(got, b"guest:80");
    }
    let got = world::tcp_exchange_in(&k.ns, SocketAddrV4::new(GUEST_IP, 8443), b"", T).unwrap();
    assert_eq!(got, b"guest:8443");
    let got = world::udp_exchange_in(&k.ns, SocketAddrV4::new(GUEST_IP, 7), b"ping?", T).unwrap();
    assert_eq!(got, b"ping?");
    // The capture saw the kernel's frames too (its ARP request or TCP SYN).
    assert!(!g.recv_raw_frames(Duration::ZERO).is_empty());
}

#[test]
fn raw_guest_gets_the_kernel_arp_reply() {
    require_root!();
    let k = KernelTap::new();
    let raw = RawGuest::new(k.fd());
    let arp = raw.arp(GATEWAY_IP, T).expect("an ARP reply");
    assert_eq!(arp.op, ARP_REPLY);
    assert_eq!(arp.sender_mac, GATEWAY_MAC);
    assert_eq!(arp.eth_src, GATEWAY_MAC);
    assert_eq!((arp.target_mac, arp.target_ip), (GUEST_MAC, GUEST_IP));
    assert_eq!(arp.eth_dst, GUEST_MAC);
    drop(raw);

    // The same through a smoltcp guest's raw side channel.
    let g = k.guest();
    g.send_raw_frame(&arp_request(GUEST_MAC, GUEST_IP, GATEWAY_IP))
        .unwrap();
    let reply = g
        .wait_raw_frame(T, |f| {
            parse_arp(f).is_some_and(|a| a.op == ARP_REPLY && a.sender_ip == GATEWAY_IP)
        })
        .expect("an ARP reply in the capture");
    assert_eq!(parse_arp(&reply).unwrap().sender_mac, GATEWAY_MAC);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_topology_gives_the_agent_an_uplink() {
    require_root!();
    let mut env = Env::new(&["--warm-pool", "1"]);
    let w = World::attach_and_restart(&mut env);
    let c = env.client().await;
    let (_, checks) = c.health().await;
    let uplink = checks.iter().find(|c| c.0 == "uplink").unwrap();
    assert!(
        uplink.1 && uplink.2.starts_with(&format!("{UPLINK} {NODE_IP}, MTU ")),
        "{checks:?}"
    );

    let tcp = w.tcp_server(8080);
    let udp = w.udp_echo(5353);
    assert_eq!(tcp, SocketAddrV4::new(WORLD_IP, 8080));
    let r = tokio::task::spawn_blocking({
        let ns = env.ns.clone();
        move || {
            (
                world::tcp_exchange_in(&ns, tcp, b"from-node", T),
                world::udp_exchange_in(&ns, udp, b"dgram", T),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(r.0.unwrap(), b"world:from-node");
    assert_eq!(r.1.unwrap(), b"world:dgram");
    assert_eq!(w.peers(8080)[0].ip(), IpAddr::V4(NODE_IP));

    // And the other way: the world reaches a server in the node namespace.
    let node = Server::tcp(&env.ns, World::node_addr(9000), b"node:");
    let got = w
        .tcp_connect(World::node_addr(9000), b"from-world", T)
        .unwrap();
    assert_eq!(got, b"node:from-world");
    assert_eq!(node.peers()[0].ip(), IpAddr::V4(WORLD_IP));
    // on_node really runs in the node namespace: only there is NODE_IP local.
    assert!(w.on_node(|| std::net::UdpSocket::bind((NODE_IP, 0)).is_ok()));
    assert!(w.run(|| std::net::UdpSocket::bind((NODE_IP, 0)).is_err()));
}
