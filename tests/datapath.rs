//! The eBPF datapath with real packets: smoltcp guests on the far side of
//! the agent's TAPs (fd from OpenTap), a "world" namespace behind the
//! node's uplink, the node namespace itself as "the host". Root only.

mod common;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4};
use std::time::Duration;

use common::guest::{self, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC, Guest, RawGuest};
use common::world::{self, World, counter, guest_for, node};
use common::{Env, mappings, opts, ports, s};
use zbus::zvariant::Value;

const T: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_snat_tcp_udp_icmp_for_two_sandboxes_with_the_same_guest_address() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (_, a) = guest_for(&c, "sbx-a", opts(vec![])).await;
    let (_, b) = guest_for(&c, "sbx-b", opts(vec![])).await;
    let tcp = world.tcp_server(8080);
    let udp = world.udp_echo(5353);

    let (ra, rb) = std::thread::scope(|sc| {
        let ha = sc.spawn(|| a.tcp_connect_send_recv(tcp, b"from-a", T));
        let hb = sc.spawn(|| b.tcp_connect_send_recv(tcp, b"from-b", T));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    assert_eq!(ra.unwrap(), b"world:from-a");
    assert_eq!(rb.unwrap(), b"world:from-b");
    assert_eq!(a.udp_send_recv(udp, b"ua", T).unwrap(), b"world:ua");
    assert_eq!(b.udp_send_recv(udp, b"ub", T).unwrap(), b"world:ub");
    a.ping(world::WORLD_IP, T).unwrap();
    b.ping(world::WORLD_IP, T).unwrap();

    // The world sees the node's uplink address, one distinct port per flow.
    let peers = world.peers(8080);
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert_ne!(peers[0].port(), peers[1].port());
    for p in peers.iter().chain(world.peers(5353).iter()) {
        assert_eq!(p.ip(), std::net::IpAddr::V4(world::NODE_IP), "{p}");
    }
    drop((a, b));

    // Both sandboxes use the very same guest address *and* source port to
    // the same remote: each gets its own port from the SNAT range (never
    // the guest's port, which the host's own connections might use), and
    // each reply reaches the right sandbox.
    let echo = world.udp_echo(5355);
    let src = SocketAddrV4::new(GUEST_IP, 40000);
    let ra = RawGuest::new(c.open_tap("sbx-a").await.unwrap());
    let rb = RawGuest::new(c.open_tap("sbx-b").await.unwrap());
    std::thread::sleep(Duration::from_millis(30));
    ra.send(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        src,
        echo,
        b"same-a",
    ))
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    rb.send(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        src,
        echo,
        b"same-b",
    ))
    .unwrap();
    let is_reply = |want: &'static [u8]| {
        move |f: &[u8]| {
            guest::parse_ipv4(f).is_some_and(|(s, d, p, pl)| {
                s == world::WORLD_IP && d == GUEST_IP && p == 17 && pl.ends_with(want)
            })
        }
    };
    let got_a = ra
        .recv_match(T, is_reply(b"world:same-a"))
        .expect("reply for sandbox a");
    let got_b = rb
        .recv_match(T, is_reply(b"world:same-b"))
        .expect("reply for sandbox b");
    for f in [&got_a, &got_b] {
        let (_, _, _, udp) = guest::parse_ipv4(f).unwrap();
        assert_eq!(
            u16::from_be_bytes([udp[2], udp[3]]),
            40000,
            "reply to the guest's own port"
        );
    }
    let mut ports: Vec<u16> = world.peers(5355).iter().map(|p| p.port()).collect();
    ports.sort();
    assert_eq!(ports.len(), 2, "{ports:?}");
    assert_ne!(ports[0], ports[1]);
    assert!(
        // The default range in a namespace whose ip_local_port_range is the
        // kernel's 32768-60999: outside it and outside host_port_range.
        ports.iter().all(|p| (1024..=19999).contains(p)),
        "SNAT ports come from snat_port_range only: {ports:?}"
    );
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "snat") >= 4, "{checks:?}");
    assert!(counter(&checks, "snat_reply") >= 4, "{checks:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_mappings_host_access_and_gateway_traffic() {
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let (net_a, a) = guest_for(
        &c,
        "pm-a",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
    )
    .await;
    let (net_b, b) = guest_for(
        &c,
        "pm-b",
        opts(vec![(
            "port_mappings",
            ports(&[("tcp", 80, 0, ""), ("udp", 53, 0, "")]),
        )]),
    )
    .await;
    a.tcp_listen(80).unwrap();
    b.tcp_listen(80).unwrap();
    b.udp_echo(53).unwrap();
    let ha = mappings(&net_a)[0].2;
    let hb = mappings(&net_b)[0].2;
    let hb_udp = mappings(&net_b)[1].2;

    // world -> uplink_ip:host_port -> guest:container_port
    let ns = format!("{}-w", env.ns);
    let got = world::tcp_exchange_in(&ns, World::node_addr(ha), b"x", T).unwrap();
    assert_eq!(got, b"guest:80");
    let got = world::tcp_exchange_in(&ns, World::node_addr(hb), b"x", T).unwrap();
    assert_eq!(got, b"guest:80");
    let got = world::udp_exchange_in(&ns, World::node_addr(hb_udp), b"dns?", T).unwrap();
    assert_eq!(got, b"dns?");

    // The host itself, through loopback or its own uplink address, reaches
    // the mapped port too (TCP and UDP).
    let got = world::tcp_exchange_in(&env.ns, SocketAddrV4::new(Ipv4Addr::LOCALHOST, ha), b"x", T)
        .unwrap();
    assert_eq!(got, b"guest:80");
    let got = world::tcp_exchange_in(&env.ns, World::node_addr(hb), b"x", T).unwrap();
    assert_eq!(got, b"guest:80");
    let got = world::udp_exchange_in(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, hb_udp),
        b"q",
        T,
    )
    .unwrap();
    assert_eq!(got, b"q");

    // host -> sandbox IP reaches the guest (source rewritten to the gateway).
    let ip_a: Ipv4Addr = s(&net_a, "sandbox_ip").parse().unwrap();
    let got = world::tcp_exchange_in(&env.ns, SocketAddrV4::new(ip_a, 80), b"x", T).unwrap();
    assert_eq!(got, b"guest:80");

    // guest -> gateway (169.254.68.5) reaches the host's own services.
    let host = world::Server::tcp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7070),
        b"host:",
    );
    let got = a
        .tcp_connect_send_recv(SocketAddrV4::new(GATEWAY_IP, 7070), b"hi", T)
        .unwrap();
    assert_eq!(got, b"host:hi");
    let peers = host.peers();
    assert_eq!(
        peers[0].ip(),
        std::net::IpAddr::V4(ip_a),
        "the host sees the sandbox IP"
    );

    // A changed mapping takes effect: a's port moves to an explicit one.
    c.ensure(
        "pm-a",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 28080, "")]))]),
    )
    .await
    .unwrap();
    assert_eq!(
        world::tcp_exchange_in(&ns, World::node_addr(28080), b"x", T).unwrap(),
        b"guest:80"
    );
    assert!(
        world::tcp_exchange_in(&ns, World::node_addr(ha), b"x", Duration::from_secs(1)).is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_and_changes_apply_to_new_flows() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let tcp = world.tcp_server(9090);
    let host = world::Server::tcp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7071),
        b"host:",
    );
    let gw = SocketAddrV4::new(GATEWAY_IP, 7071);
    let short = Duration::from_millis(1500);

    // No internet: only the gateway.
    let (_, g) = guest_for(
        &c,
        "pol",
        opts(vec![("allow_internet_access", Value::from(false))]),
    )
    .await;
    assert!(
        g.tcp_connect_send_recv(tcp, b"x", short).is_err(),
        "internet blocked"
    );
    assert_eq!(g.tcp_connect_send_recv(gw, b"g", T).unwrap(), b"host:g");

    // deny_out the world's /24: blocked; the gateway still works.
    let deny = || Value::from(vec!["198.51.100.0/24".to_string()]);
    c.ensure("pol", opts(vec![("deny_out", deny())]))
        .await
        .unwrap();
    assert!(g.tcp_connect_send_recv(tcp, b"x", short).is_err(), "denied");
    // allow beats deny.
    c.ensure(
        "pol",
        opts(vec![
            ("deny_out", deny()),
            ("allow_out", Value::from(vec!["198.51.100.2".to_string()])),
        ]),
    )
    .await
    .unwrap();
    assert_eq!(g.tcp_connect_send_recv(tcp, b"ok", T).unwrap(), b"world:ok");
    // Back to defaults: open again.
    c.ensure("pol", opts(vec![])).await.unwrap();
    assert_eq!(
        g.tcp_connect_send_recv(tcp, b"ok2", T).unwrap(),
        b"world:ok2"
    );
    drop(host);
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "policy_drop") >= 2, "{checks:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_arp_and_hostile_guest_traffic() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("evil", opts(vec![])).await.unwrap();
    let raw = RawGuest::new(c.open_tap("evil").await.unwrap());
    std::thread::sleep(Duration::from_millis(30));

    // Proxy ARP: the gateway and any other address answer with the gateway MAC.
    for target in [GATEWAY_IP, Ipv4Addr::new(10, 1, 2, 3)] {
        let arp = raw
            .arp(target, T)
            .unwrap_or_else(|| panic!("no ARP reply for {target}"));
        assert_eq!(arp.op, guest::ARP_REPLY);
        assert_eq!(arp.sender_mac, GATEWAY_MAC);
        assert_eq!(arp.sender_ip, target);
        assert_eq!(arp.target_mac, GUEST_MAC);
        assert_eq!(arp.eth_dst, GUEST_MAC);
    }
    // No answer for the guest's own address (duplicate address detection).
    assert!(raw.arp(GUEST_IP, Duration::from_millis(300)).is_none());

    let udp = world.udp_echo(5454);
    let good_src = SocketAddrV4::new(GUEST_IP, 40000);
    // Control: a well-formed datagram reaches the world.
    raw.send(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        good_src,
        udp,
        b"ok",
    ))
    .unwrap();
    // Spoofed source MAC, spoofed source IP, a frame addressed to another
    // MAC (a guest trying to reach another guest directly).
    let evil_mac = [0x02, 0, 0, 0, 0, 0x66];
    raw.send(&guest::udp_frame(
        evil_mac,
        GATEWAY_MAC,
        good_src,
        udp,
        b"spoof-mac",
    ))
    .unwrap();
    raw.send(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        SocketAddrV4::new(Ipv4Addr::new(169, 254, 68, 9), 40001),
        udp,
        b"spoof-ip",
    ))
    .unwrap();
    raw.send(&guest::udp_frame(
        GUEST_MAC,
        GUEST_MAC,
        good_src,
        udp,
        b"to-other-guest",
    ))
    .unwrap();
    // Malformed: truncated IP header, bad IHL, a fragment, garbage ethertype, runt.
    let mut trunc = guest::udp_frame(GUEST_MAC, GATEWAY_MAC, good_src, udp, b"t");
    trunc.truncate(20);
    raw.send(&trunc).unwrap();
    let mut bad_ihl = guest::udp_frame(GUEST_MAC, GATEWAY_MAC, good_src, udp, b"ihl");
    bad_ihl[14] = 0x42;
    raw.send(&bad_ihl).unwrap();
    let mut frag = guest::udp_frame(GUEST_MAC, GATEWAY_MAC, good_src, udp, b"frag");
    frag[20] = 0x20; // MF
    raw.send(&frag).unwrap();
    let mut weird = guest::udp_frame(GUEST_MAC, GATEWAY_MAC, good_src, udp, b"w");
    weird[12] = 0x88;
    weird[13] = 0xb5;
    raw.send(&weird).unwrap();
    let _ = raw.send(&[0u8; 10]);
    std::thread::sleep(Duration::from_millis(500));

    let peers = world.peers(5454);
    assert_eq!(
        peers.len(),
        1,
        "only the well-formed datagram arrives: {peers:?}"
    );
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "spoof_drop") >= 3, "{checks:?}");
    assert!(counter(&checks, "malformed") >= 1, "{checks:?}");
    // Nothing crashed: the agent answers and a real guest still works.
    drop(raw);
    let g = Guest::start_default(c.open_tap("evil").await.unwrap());
    let tcp = world.tcp_server(9191);
    assert_eq!(
        g.tcp_connect_send_recv(tcp, b"still", T).unwrap(),
        b"world:still"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datapath_works_while_the_agent_is_down_and_after_restart() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    let (net, g) = guest_for(
        &c,
        "cont",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    let host_port = mappings(&net)[0].2;
    let tcp = world.tcp_server(9292);
    let ns_w = world.ns.clone();
    assert_eq!(
        g.tcp_connect_send_recv(tcp, b"before", T).unwrap(),
        b"world:before"
    );

    env.kill_agent();
    // Agent dead: existing state keeps forwarding, new flows included.
    assert_eq!(
        g.tcp_connect_send_recv(tcp, b"down", T).unwrap(),
        b"world:down"
    );
    assert_eq!(
        world::tcp_exchange_in(&ns_w, World::node_addr(host_port), b"x", T).unwrap(),
        b"guest:80"
    );

    env.start_agent();
    let c = env.client().await;
    assert_eq!(
        g.tcp_connect_send_recv(tcp, b"after", T).unwrap(),
        b"world:after"
    );
    assert_eq!(
        world::tcp_exchange_in(&ns_w, World::node_addr(host_port), b"y", T).unwrap(),
        b"guest:80"
    );
    // The same guest fd kept working: the TAP was never reopened.
    let (_, checks) = c.health().await;
    let dp = checks.iter().find(|c| c.0 == "datapath_pins").unwrap();
    assert!(dp.1, "{dp:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_clears_the_datapath_before_the_tap_is_reused() {
    require_root!();
    // One pool TAP, so the released TAP is the next sandbox's TAP.
    let (env, world) = node(&["--warm-pool", "1"]);
    let c = env.client().await;
    let tcp = world.tcp_server(9393);
    let (net, g) = guest_for(
        &c,
        "old",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 27777, "")]))]),
    )
    .await;
    g.tcp_listen(80).unwrap();
    assert_eq!(g.tcp_connect_send_recv(tcp, b"o", T).unwrap(), b"world:o");
    let old_ifindex = u32::try_from(net["tap_ifindex"].try_clone().unwrap())
        .map(|i: u32| i)
        .unwrap_or(0);
    drop(g);
    assert!(c.release("old").await.unwrap());
    // The old mapping is gone at once.
    let ns_w = world.ns.clone();
    assert!(
        world::tcp_exchange_in(&ns_w, World::node_addr(27777), b"x", Duration::from_secs(1))
            .is_err()
    );

    // The next sandbox gets a TAP from the pool, with its own (strict) policy.
    let (net2, g2) = guest_for(
        &c,
        "new",
        opts(vec![("allow_internet_access", Value::from(false))]),
    )
    .await;
    let _ = old_ifindex;
    assert!(
        g2.tcp_connect_send_recv(tcp, b"n", Duration::from_millis(1500))
            .is_err(),
        "new policy, not the old one"
    );
    assert!(!mappings(&net2).iter().any(|m| m.2 == 27777));
    // Flow counts are refreshed by the reaper every 2 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    loop {
        let (_, checks) = c.health().await;
        let dp = checks.iter().find(|c| c.0 == "datapath").unwrap().2.clone();
        if dp.contains(" 0 flows") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "flows of the released sandbox remain: {dp}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The pinned flow map: (key, value) of every flow.
fn pinned_flows(
    env: &Env,
) -> Vec<(
    cube_network_agent::datapath::maps::DpCtKey,
    cube_network_agent::datapath::maps::DpCtVal,
)> {
    let ct: aya::maps::HashMap<_, cube_network_agent::datapath::maps::DpCtKey, _> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(
            aya::maps::MapData::from_pin(env.dir.join("bpf/ct")).unwrap(),
        ))
        .unwrap();
    ct.iter().flatten().collect()
}

/// The generation that owns `ip` in the pinned `by_ip` map.
fn generation_of(env: &Env, ip: Ipv4Addr) -> Option<u64> {
    let by_ip: aya::maps::HashMap<_, u32, cube_network_agent::datapath::maps::DpTap> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(
            aya::maps::MapData::from_pin(env.dir.join("bpf/by_ip")).unwrap(),
        ))
        .unwrap();
    by_ip
        .get(&u32::from_ne_bytes(ip.octets()), 0)
        .ok()
        .map(|t| t.generation)
}

fn ip_of(net: &common::Dict) -> Ipv4Addr {
    s(net, "sandbox_ip").parse().unwrap()
}

/// Release does not walk the flow maps: a released sandbox's flows stay
/// until the reaper's next pass. The next owner of the same address (a /30
/// pool has one) must never see them: late replies from the world to the
/// old SNAT ports (UDP and an open TCP connection) and to the old mapped
/// port from the old remote port do not reach the new guest, and the new
/// guest's packets on the old flows' tuples open flows of its own (a port
/// mapping it does not have is not used for them); the reaper then drops
/// the old generation's flows and keeps the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_address_never_sees_the_released_sandboxs_flows() {
    use std::io::Write;
    use std::net::{TcpListener, UdpSocket};
    require_root!();
    let (env, world) = node(&["--pool-cidr", "10.77.0.0/30"]);
    let c = env.client().await;
    let ns_w = world.ns.clone();
    let udp = world::in_netns(&ns_w, || UdpSocket::bind("0.0.0.0:5360")).unwrap();
    let udp_pm = world::in_netns(&ns_w, || UdpSocket::bind("0.0.0.0:5361")).unwrap();
    let tcp = world::in_netns(&ns_w, || TcpListener::bind("0.0.0.0:9494")).unwrap();
    for u in [&udp, &udp_pm] {
        u.set_read_timeout(Some(T)).unwrap();
    }

    let (net, old) = guest_for(
        &c,
        "old",
        opts(vec![("port_mappings", ports(&[("udp", 53, 0, "")]))]),
    )
    .await;
    let ip = ip_of(&net);
    let host_port = mappings(&net)[0].2;
    old.udp_echo(53).unwrap();
    // An open TCP connection through SNAT.
    let accept = std::thread::spawn(move || {
        let (mut s, peer) = tcp.accept().unwrap();
        s.write_all(b"hello").unwrap();
        (s, peer)
    });
    let got = old
        .tcp_exchange(
            World::world_addr(9494),
            b"hi",
            guest::TcpOpts {
                half_close: false,
                max_bytes: Some(5),
            },
            T,
        )
        .unwrap();
    assert_eq!(got, b"hello");
    let (mut conn, tcp_peer) = accept.join().unwrap();
    // A UDP flow through SNAT.
    let old_src = SocketAddrV4::new(GUEST_IP, 40000);
    old.send_raw_frame(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        old_src,
        World::world_addr(5360),
        b"old-udp",
    ))
    .unwrap();
    let mut buf = [0u8; 1500];
    let (n, udp_peer) = udp.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"old-udp");
    // A UDP flow the world opened through the port mapping.
    udp_pm.send_to(b"pm", World::node_addr(host_port)).unwrap();
    let (n, from) = udp_pm.recv_from(&mut buf).unwrap();
    assert_eq!((&buf[..n], from.port()), (&b"pm"[..], host_port));
    let old_gen = generation_of(&env, ip).expect("by_ip entry of the old sandbox");
    drop(old);
    assert!(c.release("old").await.unwrap());

    // The next sandbox gets the same address (and no port mapping).
    let (net2, new) = guest_for(&c, "new", opts(vec![])).await;
    assert_eq!(ip_of(&net2), ip, "a /30 pool has one address");
    let new_gen = generation_of(&env, ip).unwrap();
    assert_ne!(new_gen, old_gen, "a new owner gets a new generation");
    std::thread::sleep(Duration::from_millis(50));
    new.clear_raw_frames();

    // Late replies to the old flows.
    udp.send_to(b"late-udp", udp_peer).unwrap();
    udp_pm
        .send_to(b"late-pm", World::node_addr(host_port))
        .unwrap();
    // (The connection may already be reset by the node's stack, which is
    // fine: then no late segment exists to leak.)
    let _ = conn.write_all(b"late-tcp");
    let leaked: Vec<_> = new
        .recv_raw_frames(Duration::from_millis(800))
        .into_iter()
        .filter(|f| {
            guest::parse_ipv4(f).is_some_and(|(src, _, _, l4)| {
                src == world::WORLD_IP
                    && l4.len() >= 2
                    && [5360, 5361, 9494].contains(&u16::from_be_bytes([l4[0], l4[1]]))
            })
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "the old flows' packets reached the new owner of {ip} (old SNAT port {}, TCP {tcp_peer}): {leaked:?}",
        udp_peer.port()
    );

    // The new guest's own packets on the very tuples of the old flows open
    // flows of their own and work.
    new.send_raw_frame(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        old_src,
        World::world_addr(5360),
        b"new-udp",
    ))
    .unwrap();
    let (n, peer) = loop {
        let (n, peer) = udp.recv_from(&mut buf).unwrap();
        if &buf[..n] == b"new-udp" {
            break (n, peer);
        }
    };
    assert_eq!(&buf[..n], b"new-udp");
    udp.send_to(b"ans", peer).unwrap();
    new.wait_raw_frame(T, |f| {
        guest::parse_ipv4(f).is_some_and(|(src, dst, p, l4)| {
            src == world::WORLD_IP
                && dst == GUEST_IP
                && p == 17
                && l4.len() >= 8
                && u16::from_be_bytes([l4[2], l4[3]]) == 40000
                && l4.ends_with(b"ans")
        })
    })
    .expect("the reply to the new guest's own flow");
    // From the old mapping's container port to the old remote: an ordinary
    // SNAT flow now, never the old mapped port.
    new.send_raw_frame(&guest::udp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        SocketAddrV4::new(GUEST_IP, 53),
        World::world_addr(5361),
        b"new-53",
    ))
    .unwrap();
    let peer = loop {
        let (n, peer) = udp_pm.recv_from(&mut buf).unwrap();
        if &buf[..n] == b"new-53" {
            break peer;
        }
    };
    assert_ne!(
        peer.port(),
        host_port,
        "the new guest's packet left through the released sandbox's port mapping"
    );
    let echo = world.udp_echo(5362);
    assert_eq!(new.udp_send_recv(echo, b"u", T).unwrap(), b"world:u");
    let tcp2 = world.tcp_server(9495);
    assert_eq!(
        new.tcp_connect_send_recv(tcp2, b"t", T).unwrap(),
        b"world:t"
    );

    // The reaper drops what is left of the old generation and keeps the
    // new owner's flows.
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    loop {
        let flows = pinned_flows(&env);
        let mine = |g: u64| {
            flows
                .iter()
                .filter(|(k, v)| {
                    k.sandbox_ip == u32::from_ne_bytes(ip.octets()) && v.generation == g
                })
                .count()
        };
        if mine(old_gen) == 0 {
            assert!(mine(new_gen) >= 2, "the new owner's flows stay: {flows:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "flows of the released sandbox remain: {flows:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(conn);
}

/// Release leaves the flows to the reaper, which removes every flow of a
/// released sandbox on its next pass (UDP flows would otherwise stay for
/// their 60 s timeout) and keeps the others'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_drops_a_released_sandboxs_flows() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let echo = world.udp_echo(5370);
    let tcp = world.tcp_server(9496);
    let (net_keep, keep) = guest_for(&c, "keep", opts(vec![])).await;
    let (net_gone, gone) = guest_for(&c, "gone", opts(vec![])).await;
    for g in [&keep, &gone] {
        assert_eq!(g.udp_send_recv(echo, b"u", T).unwrap(), b"world:u");
        assert_eq!(g.tcp_connect_send_recv(tcp, b"t", T).unwrap(), b"world:t");
    }
    let (ip_keep, ip_gone) = (
        u32::from_ne_bytes(ip_of(&net_keep).octets()),
        u32::from_ne_bytes(ip_of(&net_gone).octets()),
    );
    let count = |flows: &[(
        cube_network_agent::datapath::maps::DpCtKey,
        cube_network_agent::datapath::maps::DpCtVal,
    )],
                 ip: u32| flows.iter().filter(|(k, _)| k.sandbox_ip == ip).count();
    let before = pinned_flows(&env);
    let kept = count(&before, ip_keep);
    assert!(kept >= 2 && count(&before, ip_gone) >= 2, "{before:?}");
    drop(gone);
    assert!(c.release("gone").await.unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    loop {
        let flows = pinned_flows(&env);
        let (_, checks) = c.health().await;
        let dp = checks.iter().find(|c| c.0 == "datapath").unwrap().2.clone();
        if count(&flows, ip_gone) == 0 && dp.contains(&format!(" {} flows", flows.len())) {
            assert_eq!(count(&flows, ip_keep), kept, "{flows:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "flows of the released sandbox remain: {flows:?} ({dp})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(keep);
}

/// The world namespace's TCP `OutRsts` (resets its kernel sent).
fn world_out_rsts(world: &World) -> u64 {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &world.ns, "cat", "/proc/net/snmp"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap(), tcp.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == "OutRsts")
        .unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// A guest restored from a snapshot keeps connections its new sandbox
/// never opened: their segments must not leave (the world's firewall may
/// drop them, and the connection would hang until the guest gives up) but
/// end at once with the RST a closed port sends, made by the datapath.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_segment_of_a_connection_the_sandbox_never_opened_gets_an_rst() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("restored", opts(vec![])).await.unwrap();
    let raw = RawGuest::new(c.open_tap("restored").await.unwrap());
    let server = world.tcp_server(8080);
    let rsts_before = world_out_rsts(&world);
    let from = SocketAddrV4::new(GUEST_IP, 41000);
    let rst_for = |port: u16| {
        move |f: &[u8]| {
            guest::parse_tcp(f)
                .is_some_and(|t| t.dst.port() == port && t.flags & guest::TCP_RST != 0)
        }
    };

    // Data with ACK (an established connection's next segment): RST, SEQ =
    // the segment's ACK, from the remote's address and port, to the guest.
    let seg = guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from,
        server,
        1000,
        5000,
        guest::TCP_ACK | guest::TCP_PSH,
        b"stale data",
    );
    raw.send(&seg).unwrap();
    let f = raw
        .recv_match(T, rst_for(41000))
        .expect("no RST for a stale ACK segment");
    let rst = guest::parse_tcp(&f).unwrap();
    assert_eq!(
        (rst.src, rst.dst, rst.seq, rst.flags, rst.payload.len()),
        (server, from, 5000, guest::TCP_RST, 0),
        "{rst:?}"
    );
    assert!(rst.checksums_ok, "{rst:?}");
    assert_eq!(guest::eth_src(&f), Some(GATEWAY_MAC));
    assert_eq!(guest::eth_dst(&f), Some(GUEST_MAC));

    // No ACK (a FIN alone): RST+ACK acknowledging the segment (FIN counts 1).
    let from2 = SocketAddrV4::new(GUEST_IP, 41001);
    raw.send(&guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from2,
        server,
        7000,
        0,
        guest::TCP_FIN,
        b"xyz",
    ))
    .unwrap();
    let f = raw
        .recv_match(T, rst_for(41001))
        .expect("no RST for a stale FIN");
    let rst = guest::parse_tcp(&f).unwrap();
    assert_eq!(
        (rst.seq, rst.ack, rst.flags),
        (0, 7004, guest::TCP_RST | guest::TCP_ACK),
        "{rst:?}"
    );
    assert!(rst.checksums_ok, "{rst:?}");

    // The same from a VMM with checksum offload (a partial checksum): the
    // RST's checksum is right once the receiving side completes it.
    let from3 = SocketAddrV4::new(GUEST_IP, 41002);
    raw.send_partial_csum(&guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from3,
        server,
        9000,
        123_456,
        guest::TCP_ACK,
        &[7u8; 600],
    ))
    .unwrap();
    let f = raw
        .recv_match(T, rst_for(41002))
        .expect("no RST for a partial-checksum segment");
    let rst = guest::parse_tcp(&f).unwrap();
    assert_eq!((rst.seq, rst.flags), (123_456, guest::TCP_RST), "{rst:?}");
    assert!(rst.checksums_ok, "{rst:?}");

    // An RST is never answered.
    let from4 = SocketAddrV4::new(GUEST_IP, 41003);
    raw.send(&guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from4,
        server,
        1,
        0,
        guest::TCP_RST,
        b"",
    ))
    .unwrap();
    assert!(
        raw.recv_match(Duration::from_millis(300), |f| guest::parse_tcp(f)
            .is_some())
            .is_none(),
        "an RST was answered"
    );

    // Nothing reached the world (its kernel would have reset the unknown
    // segments itself), and the sandbox and node counters say why.
    assert_eq!(
        world_out_rsts(&world),
        rsts_before,
        "a stale segment reached the world"
    );
    assert!(world.peers(8080).is_empty());
    let t = c.traffic("restored").await;
    assert_eq!(t["drop_stale_tcp"], 4, "{t:?}");
    assert_eq!(t["new_flows_snat"], 0, "{t:?}");
    let (_, checks) = c.health().await;
    assert_eq!(counter(&checks, "stale_tcp"), 4, "{checks:?}");

    // Strict egress: TCP to 443 goes to the agent's proxy; a stale
    // segment there (no proxy flow) gets its RST too, from the address
    // the guest dialled.
    c.ensure(
        "strict",
        opts(vec![
            ("egress_mode", Value::from("sni")),
            ("allow_out", Value::from(vec!["example.com".to_string()])),
        ]),
    )
    .await
    .unwrap();
    let strict = RawGuest::new(c.open_tap("strict").await.unwrap());
    let https = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 9), 443);
    let from5 = SocketAddrV4::new(GUEST_IP, 41004);
    strict
        .send(&guest::tcp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            from5,
            https,
            55,
            77,
            guest::TCP_ACK | guest::TCP_PSH,
            b"tls bytes",
        ))
        .unwrap();
    let f = strict
        .recv_match(T, rst_for(41004))
        .expect("no RST for a stale segment to the proxy");
    let rst = guest::parse_tcp(&f).unwrap();
    assert_eq!(
        (rst.src, rst.seq, rst.flags),
        (https, 77, guest::TCP_RST),
        "{rst:?}"
    );
    assert!(rst.checksums_ok, "{rst:?}");
    assert_eq!(c.traffic("strict").await["drop_stale_tcp"], 1);

    // A SYN still opens a connection as before.
    drop(raw);
    let g = Guest::start_default(c.open_tap("restored").await.unwrap());
    assert_eq!(
        g.tcp_connect_send_recv(server, b"fresh", T).unwrap(),
        b"world:fresh"
    );
    drop(env);
}

/// A raw guest's TCP handshake with `server` from `from` (SYN out, the
/// world's SYN-ACK back): the SYN-ACK.
fn raw_handshake(raw: &RawGuest, from: SocketAddrV4, server: SocketAddrV4) -> guest::TcpSeg {
    raw.send(&guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from,
        server,
        100,
        0,
        guest::TCP_SYN,
        b"",
    ))
    .unwrap();
    let synack = raw
        .recv_match(T, |f| {
            guest::parse_tcp(f).is_some_and(|t| t.flags == guest::TCP_SYN | guest::TCP_ACK)
        })
        .expect("no SYN-ACK from the world");
    let synack = guest::parse_tcp(&synack).unwrap();
    assert_eq!(synack.ack, 101);
    synack
}

/// The handshake's ACK with `data` and FIN after [`raw_handshake`]: what
/// the world's server answers on the same connection (an RST fails).
fn raw_finish(
    raw: &RawGuest,
    from: SocketAddrV4,
    server: SocketAddrV4,
    synack: &guest::TcpSeg,
) -> Vec<u8> {
    raw.send(&guest::tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        from,
        server,
        101,
        synack.seq.wrapping_add(1),
        guest::TCP_ACK | guest::TCP_PSH | guest::TCP_FIN,
        b"still here",
    ))
    .unwrap();
    let reply = raw
        .recv_match(T, |f| {
            guest::parse_tcp(f)
                .is_some_and(|t| !t.payload.is_empty() || t.flags & guest::TCP_RST != 0)
        })
        .map(|f| guest::parse_tcp(&f).unwrap())
        .expect("nothing came back on the flow");
    assert_eq!(
        reply.flags & guest::TCP_RST,
        0,
        "the live flow was reset: {reply:?}"
    );
    reply.payload
}

/// A restart keeps every flow (pinned maps): the next segment of a TCP
/// connection opened before a kill -9 goes on, never taken for a stale one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_connection_opened_before_a_kill_goes_on_after_the_restart() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("kept", opts(vec![])).await.unwrap();
    let raw = RawGuest::new(c.open_tap("kept").await.unwrap());
    let server = world.tcp_server(8080);
    let from = SocketAddrV4::new(GUEST_IP, 43000);
    let synack = raw_handshake(&raw, from, server);
    drop(c);
    env.kill_agent();
    env.start_agent();
    assert_eq!(raw_finish(&raw, from, server, &synack), b"world:still here");
    assert_eq!(world.peers(8080).len(), 1, "{:?}", world.peers(8080));
    let c = env.client().await;
    assert_eq!(c.traffic("kept").await["drop_stale_tcp"], 0);
    drop(env);
}

/// `ct` is an LRU: a live flow whose entry was evicted must not be taken
/// for a stale one. Its SNAT reverse entry still names its port, and the
/// flow goes on with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_flow_whose_flow_entry_was_evicted_goes_on_with_its_port() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("evicted", opts(vec![])).await.unwrap();
    let raw = RawGuest::new(c.open_tap("evicted").await.unwrap());
    let server = world.tcp_server(8080);
    let from = SocketAddrV4::new(GUEST_IP, 42000);
    let synack = raw_handshake(&raw, from, server);

    // Evict: every flow entry goes, the reverse entries stay.
    let ct = env.dir.join("bpf").join("ct").display().to_string();
    let dump: serde_json::Value =
        serde_json::from_str(&env.ns_cmd(&["bpftool", "-j", "map", "dump", "pinned", &ct]))
            .unwrap();
    let flows = dump.as_array().unwrap();
    assert_eq!(flows.len(), 1, "{dump}");
    let mut args = vec!["bpftool", "map", "delete", "pinned", &ct, "key", "hex"];
    let key: Vec<String> = flows[0]["key"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap().trim_start_matches("0x").to_owned())
        .collect();
    args.extend(key.iter().map(String::as_str));
    env.ns_cmd(&args);

    // The handshake's ACK with data and FIN: the world answers on the
    // same connection.
    assert_eq!(raw_finish(&raw, from, server, &synack), b"world:still here");
    assert_eq!(world.peers(8080).len(), 1, "{:?}", world.peers(8080));
    let t = c.traffic("evicted").await;
    assert_eq!(t["drop_stale_tcp"], 0, "{t:?}");
    let (_, checks) = c.health().await;
    assert_eq!(counter(&checks, "stale_tcp_rescued"), 1, "{checks:?}");
    drop(env);
}

/// The ICMPv6 message of a frame the datapath sent the guest, if it is
/// one of `ty` from `src`; its checksum must be right.
fn icmp6_from(f: &[u8], ty: u8, src: Ipv6Addr) -> Option<guest::Ip6Pkt> {
    let p = guest::parse_ip6(f)?;
    (p.next == 58 && p.l4.first() == Some(&ty) && p.src == src).then_some(p)
}

/// The ND options of an RA or NA (after `fixed` bytes of message):
/// (type, body).
fn nd_options(l4: &[u8], fixed: usize) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut o = &l4[fixed..];
    while o.len() >= 8 && o[1] != 0 {
        let n = usize::from(o[1]) * 8;
        out.push((o[0], o[2..n.min(o.len())].to_vec()));
        o = &o[n.min(o.len())..];
    }
    out
}

/// The guests' IPv6 link (docs/dual-stack.md), with no IPv6 egress yet:
/// a Router Solicitation gets the fixed prefix for SLAAC and no default
/// route; the gateway answers Neighbour Solicitations and echo; anything
/// sent off the link is refused at once (TCP: RST, else ICMPv6
/// unreachable), never left to time out; DAD gets no NA but an RA; spoofed
/// sources and a guest's RA or DHCPv6 server messages are dropped and
/// counted. With `ipv6 = off` nothing is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guests_ipv6_link_answers_and_refuses_at_once() {
    use guest::{GATEWAY_IP6, GATEWAY_LL, GUEST_IP6, GUEST_LL, GUEST_SLAAC, ip6_frame};
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let net = c.ensure("v6", opts(vec![])).await.unwrap();
    assert_eq!(
        (s(&net, "guest_ipv6"), s(&net, "gateway_ipv6")),
        ("fd63:7562:6500::6/64".into(), GATEWAY_LL.to_string())
    );
    let raw = RawGuest::new(c.open_tap("v6").await.unwrap());
    let all_routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);
    let mcast_mac = |a: Ipv6Addr| {
        let o = a.octets();
        [0x33, 0x33, o[12], o[13], o[14], o[15]]
    };

    // RS -> RA: from the gateway's link-local address and MAC, hop limit
    // 255, router lifetime 0 (no default route: no IPv6 egress yet), the
    // gateway MAC, and fd63:7562:6500::/64 on-link and autonomous with
    // infinite lifetimes.
    let rs = [133u8, 0, 0, 0, 0, 0, 0, 0];
    raw.send(&ip6_frame(
        GUEST_MAC,
        mcast_mac(all_routers),
        GUEST_LL,
        all_routers,
        58,
        255,
        &rs,
    ))
    .unwrap();
    let f = raw
        .recv_match(T, |f| icmp6_from(f, 134, GATEWAY_LL).is_some())
        .expect("no Router Advertisement for a Router Solicitation");
    let ra = guest::parse_ip6(&f).unwrap();
    assert!(ra.checksum_ok, "{ra:?}");
    assert_eq!(
        (ra.hlim, ra.dst),
        (255, Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1))
    );
    assert_eq!(
        (guest::eth_src(&f), guest::eth_dst(&f)),
        (Some(GATEWAY_MAC), Some(GUEST_MAC))
    );
    assert_eq!(
        u16::from_be_bytes([ra.l4[6], ra.l4[7]]),
        0,
        "router lifetime"
    );
    let opts6 = nd_options(&ra.l4, 16);
    assert!(opts6.contains(&(1, GATEWAY_MAC.to_vec())), "{opts6:?}");
    let pi = &opts6
        .iter()
        .find(|o| o.0 == 3)
        .expect("no prefix information")
        .1;
    assert_eq!((pi[0], pi[1] & 0xc0), (64, 0xc0), "{pi:?}");
    assert_eq!(&pi[2..10], &[0xff; 8], "{pi:?}");
    assert_eq!(
        &pi[14..22],
        &[0xfd, 0x63, 0x75, 0x62, 0x65, 0, 0, 0],
        "{pi:?}"
    );
    // RDNSS (RFC 8106): the agent's resolver at the gateway's
    // fd63:7562:6500::5, infinite (the node reaches sandboxes over IPv6).
    let rdnss = &opts6
        .iter()
        .find(|o| o.0 == 25)
        .expect("no Recursive DNS Server option")
        .1;
    assert_eq!(&rdnss[2..6], &[0xff; 4], "{rdnss:?}");
    assert_eq!(&rdnss[6..22], &GATEWAY_IP6.octets(), "{rdnss:?}");

    // NS for either gateway address -> NA (router, solicited, override,
    // the gateway MAC); for anything else on the link: nothing.
    for (src, target) in [
        (GUEST_LL, GATEWAY_LL),
        (GUEST_IP6, GATEWAY_IP6),
        (GUEST_SLAAC, GATEWAY_LL),
    ] {
        let mut ns = vec![135u8, 0, 0, 0, 0, 0, 0, 0];
        ns.extend_from_slice(&target.octets());
        ns.extend_from_slice(&[1, 1]);
        ns.extend_from_slice(&GUEST_MAC);
        raw.send(&ip6_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            src,
            target,
            58,
            255,
            &ns,
        ))
        .unwrap();
        let f = raw
            .recv_match(T, |f| icmp6_from(f, 136, target).is_some())
            .unwrap_or_else(|| panic!("no NA for {target} asked by {src}"));
        let na = guest::parse_ip6(&f).unwrap();
        assert!(na.checksum_ok, "{na:?}");
        assert_eq!(
            (na.dst, na.hlim, na.l4[4] & 0xe0),
            (src, 255, 0xe0),
            "{na:?}"
        );
        assert_eq!(&na.l4[8..24], &target.octets());
        assert_eq!(nd_options(&na.l4, 24), vec![(2, GATEWAY_MAC.to_vec())]);
    }
    let other = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 9);
    let mut ns = vec![135u8, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&other.octets());
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        other,
        58,
        255,
        &ns,
    ))
    .unwrap();
    // DAD for the guest's own address (from ::): not answered either.
    let mut dad = vec![135u8, 0, 0, 0, 0, 0, 0, 0];
    dad.extend_from_slice(&GUEST_IP6.octets());
    let solicited = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 1, 0xff00, 6);
    raw.send(&ip6_frame(
        GUEST_MAC,
        mcast_mac(solicited),
        Ipv6Addr::UNSPECIFIED,
        solicited,
        58,
        255,
        &dad,
    ))
    .unwrap();
    // A DAD probe is never answered with an NA (the address is the
    // guest's), but it means the guest's link just came up: an RA follows.
    let mut got = Vec::new();
    let _ = raw.recv_match(Duration::from_millis(300), |f| {
        if let Some(p) = guest::parse_ip6(f) {
            got.push((p.src, p.l4[0]));
        }
        false
    });
    assert_eq!(got, vec![(GATEWAY_LL, 134)], "answered: {got:?}");

    // Echo to the gateway -> echo reply with the same id, sequence, data.
    let echo = [128u8, 0, 0, 0, 0x12, 0x34, 0, 7, b'p', b'i', b'n', b'g'];
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        GATEWAY_IP6,
        58,
        64,
        &echo,
    ))
    .unwrap();
    let f = raw
        .recv_match(T, |f| icmp6_from(f, 129, GATEWAY_IP6).is_some())
        .expect("no echo reply from the gateway");
    let reply = guest::parse_ip6(&f).unwrap();
    assert!(reply.checksum_ok, "{reply:?}");
    assert_eq!((reply.dst, &reply.l4[4..]), (GUEST_IP6, &echo[4..]));

    // Off the link: a SYN gets RST|ACK from the address it dialled, at once.
    let remote = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
    let rst_to = |port: u16| {
        move |f: &[u8]| {
            guest::parse_ip6(f).is_some_and(|p| {
                p.next == 6
                    && u16::from_be_bytes([p.l4[2], p.l4[3]]) == port
                    && p.l4[13] & guest::TCP_RST != 0
            })
        }
    };
    let syn = guest::tcp6_segment(42000, 443, 1000, 0, guest::TCP_SYN, b"");
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_SLAAC,
        remote,
        6,
        64,
        &syn,
    ))
    .unwrap();
    let f = raw
        .recv_match(T, rst_to(42000))
        .expect("no RST for an IPv6 SYN off the link");
    let rst = guest::parse_ip6(&f).unwrap();
    assert!(rst.checksum_ok, "{rst:?}");
    let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    assert_eq!(
        (
            rst.src,
            rst.dst,
            u16::from_be_bytes([rst.l4[0], rst.l4[1]]),
            be32(&rst.l4[8..]),
            rst.l4[13]
        ),
        (
            remote,
            GUEST_SLAAC,
            443,
            1001,
            guest::TCP_RST | guest::TCP_ACK
        ),
        "{rst:?}"
    );
    // ... and so does a data segment from a VMM with checksum offload.
    let data = guest::tcp6_segment(
        42001,
        80,
        5,
        9999,
        guest::TCP_ACK | guest::TCP_PSH,
        &[1u8; 300],
    );
    raw.send_partial_csum6(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        remote,
        6,
        64,
        &data,
    ))
    .unwrap();
    let f = raw
        .recv_match(T, rst_to(42001))
        .expect("no RST for a partial-checksum segment");
    let rst = guest::parse_ip6(&f).unwrap();
    assert!(rst.checksum_ok, "{rst:?}");
    assert_eq!(
        (be32(&rst.l4[4..]), rst.l4[13]),
        (9999, guest::TCP_RST),
        "{rst:?}"
    );

    // UDP off the link: destination unreachable (no route) from the
    // gateway, quoting the datagram's header; with and without offload.
    let udp = guest::udp6_datagram(42002, 53, b"query");
    let datagram = ip6_frame(GUEST_MAC, GATEWAY_MAC, GUEST_IP6, remote, 17, 64, &udp);
    for partial in [false, true] {
        if partial {
            raw.send_partial_csum6(&datagram).unwrap();
        } else {
            raw.send(&datagram).unwrap();
        }
        let f = raw
            .recv_match(T, |f| icmp6_from(f, 1, GATEWAY_LL).is_some())
            .unwrap_or_else(|| panic!("no unreachable for UDP (partial: {partial})"));
        let e = guest::parse_ip6(&f).unwrap();
        assert!(e.checksum_ok, "partial {partial}: {e:?}");
        assert_eq!((e.dst, e.l4[1]), (GUEST_IP6, 0), "{e:?}");
        assert_eq!(&e.l4[8..8 + 40], &datagram[14..54], "quoted header");
        assert_eq!(&e.l4[48..52], &datagram[54..58], "quoted ports");
    }

    // Hostile: a spoofed source, a guest's RA, a DHCPv6 server's reply.
    let (healthy, checks) = c.health().await;
    let dp = &checks.iter().find(|c| c.0 == "datapath").unwrap().2;
    assert!(healthy && dp.contains("ipv6=link "), "{checks:?}");
    let (rogue0, spoof0) = (counter(&checks, "rogue_nd"), counter(&checks, "spoof_drop"));
    let spoofed = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 7);
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        spoofed,
        remote,
        6,
        64,
        &syn,
    ))
    .unwrap();
    let mut rogue_ra = vec![134u8, 0, 0, 0, 64, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0];
    rogue_ra.extend_from_slice(&[1, 1]);
    rogue_ra.extend_from_slice(&GUEST_MAC);
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    raw.send(&ip6_frame(
        GUEST_MAC,
        mcast_mac(all_nodes),
        GUEST_LL,
        all_nodes,
        58,
        255,
        &rogue_ra,
    ))
    .unwrap();
    let dhcp = guest::udp6_datagram(547, 546, b"advertise");
    raw.send(&ip6_frame(
        GUEST_MAC,
        mcast_mac(all_nodes),
        GUEST_LL,
        all_nodes,
        17,
        64,
        &dhcp,
    ))
    .unwrap();
    assert!(
        raw.recv_match(Duration::from_millis(300), |f| guest::parse_ip6(f)
            .is_some())
            .is_none(),
        "a spoofed or rogue packet was answered"
    );
    let (_, checks) = c.health().await;
    assert_eq!(counter(&checks, "rogue_nd") - rogue0, 2, "{checks:?}");
    assert_eq!(counter(&checks, "spoof_drop") - spoof0, 1, "{checks:?}");
    assert_eq!(
        counter(&checks, "nd_reply"),
        6,
        "2 RA, 3 NA, 1 echo: {checks:?}"
    );
    assert_eq!(counter(&checks, "ipv6_refused"), 4, "{checks:?}");
    let t = c.traffic("v6").await;
    assert_eq!((t["drop_spoofed"], t["drop_no_route"]), (3, 4), "{t:?}");
    assert_eq!(t["new_flows_snat"], 0, "{t:?}");
    drop(env);

    // ipv6 = off: the builds before (every IPv6 frame dropped).
    let (env, _world) = node(&["--ipv6", "off"]);
    let c = env.client().await;
    let net = c.ensure("off", opts(vec![])).await.unwrap();
    assert!(
        !net.contains_key("guest_ipv6") && !net.contains_key("gateway_ipv6"),
        "{net:?}"
    );
    let raw = RawGuest::new(c.open_tap("off").await.unwrap());
    raw.send(&ip6_frame(
        GUEST_MAC,
        mcast_mac(all_routers),
        GUEST_LL,
        all_routers,
        58,
        255,
        &rs,
    ))
    .unwrap();
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        remote,
        6,
        64,
        &syn,
    ))
    .unwrap();
    assert!(
        raw.recv_match(Duration::from_millis(500), |f| guest::parse_ip6(f)
            .is_some())
            .is_none(),
        "ipv6 = off answered"
    );
    assert_eq!(c.traffic("off").await["drop_unsupported"], 2);
    let (_, checks) = c.health().await;
    let dp = &checks.iter().find(|c| c.0 == "datapath").unwrap().2;
    assert!(dp.contains("ipv6=off"), "{checks:?}");
    drop(env);
}

/// A raw guest on a new network `id` whose udp/5300 is mapped, and the
/// mapping's host port.
async fn udp_mapped_raw_guest(c: &common::Client, id: &str) -> (RawGuest, u16) {
    let net = c
        .ensure(
            id,
            opts(vec![("port_mappings", ports(&[("udp", 5300, 0, "")]))]),
        )
        .await
        .unwrap();
    (
        RawGuest::new(c.open_tap(id).await.unwrap()),
        mappings(&net)[0].2,
    )
}

/// Sends with `send` until `answer` (waiting up to a second each time)
/// has a frame, for at most twice `T`. One datagram and its one answer
/// (an ICMP error, a mapped datagram) are each a single packet: on a
/// loaded machine a packet can wait or go (a CPU's backlog is shared by
/// every namespace), so a test that needs an answer asks again instead of
/// waiting once. Once a second stays within the world kernel's ICMP rate
/// limit (a burst of 6 per destination, then one a second).
fn ask(
    mut send: impl FnMut(),
    mut answer: impl FnMut(Duration) -> Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    let deadline = std::time::Instant::now() + 2 * T;
    loop {
        send();
        if let Some(f) = answer(Duration::from_secs(1)) {
            return Some(f);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
    }
}

/// A frame is a UDP datagram for the guest ending in `payload`.
fn udp_to_guest_ending(payload: &'static [u8]) -> impl Fn(&[u8]) -> bool {
    move |f: &[u8]| {
        guest::parse_ipv4(f)
            .is_some_and(|(_, d, p, l4)| p == 17 && d == GUEST_IP && l4.ends_with(payload))
    }
}

/// An ICMP error from the world about a sandbox's flow reaches the guest
/// as if its own packet had met it (path MTU discovery lives on
/// "fragmentation needed"; here the world kernel's own port unreachable):
/// for a flow the sandbox opened and for its side of a port-mapped one,
/// the quoted packet names the guest's address and port, every checksum
/// is right, and another sandbox with the same guest tuple gets only its
/// own errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn icmp_errors_about_a_sandbox_flow_reach_its_guest_translated() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (a, hp) = udp_mapped_raw_guest(&c, "icmp-a").await;
    c.ensure("icmp-b", opts(vec![])).await.unwrap();
    let b = RawGuest::new(c.open_tap("icmp-b").await.unwrap());
    let is_error = |f: &[u8]| guest::parse_icmp_error(f).is_some();

    // A datagram to a world port nobody listens on: port unreachable.
    let from = SocketAddrV4::new(GUEST_IP, 43000);
    let closed = SocketAddrV4::new(world::WORLD_IP, 5999);
    let f = ask(
        || {
            a.send(&guest::udp_frame(
                GUEST_MAC,
                GATEWAY_MAC,
                from,
                closed,
                b"anyone?",
            ))
            .unwrap();
        },
        |t| a.recv_match(t, is_error),
    )
    .expect("no ICMP error for a datagram to a closed world port");
    let e = guest::parse_icmp_error(&f).unwrap();
    assert_eq!(
        (
            e.src,
            e.dst,
            e.kind,
            e.inner_src,
            e.inner_dst,
            e.inner_proto
        ),
        (world::WORLD_IP, GUEST_IP, (3, 3), from, closed, 17),
        "{e:?}"
    );
    assert!(e.checksums_ok, "{e:?}");
    assert_eq!(
        (guest::eth_src(&f), guest::eth_dst(&f)),
        (Some(GATEWAY_MAC), Some(GUEST_MAC))
    );
    // The same guest tuple from another sandbox: its own error only.
    let f = ask(
        || {
            b.send(&guest::udp_frame(
                GUEST_MAC,
                GATEWAY_MAC,
                from,
                closed,
                b"me too",
            ))
            .unwrap();
        },
        |t| b.recv_match(t, is_error),
    )
    .expect("no ICMP error for the other sandbox");
    assert!(guest::parse_icmp_error(&f).unwrap().checksums_ok);
    assert!(
        a.recv_match(Duration::from_millis(300), is_error).is_none(),
        "another sandbox's error reached this guest"
    );

    // A port-mapped flow: the world sends from a socket it then closes
    // (only once the guest has the datagram); the guest's answer meets
    // port unreachable.
    let ws = world.run(|| std::net::UdpSocket::bind("0.0.0.0:0").unwrap());
    let wport = ws.local_addr().unwrap().port();
    ask(
        || {
            ws.send_to(b"ping", SocketAddrV4::new(world::NODE_IP, hp))
                .unwrap();
        },
        |t| a.recv_match(t, udp_to_guest_ending(b"ping")),
    )
    .expect("the mapped datagram");
    drop(ws);
    let wsrc = SocketAddrV4::new(world::WORLD_IP, wport);
    let mapped = SocketAddrV4::new(GUEST_IP, 5300);
    let f = ask(
        || {
            a.send(&guest::udp_frame(
                GUEST_MAC,
                GATEWAY_MAC,
                mapped,
                wsrc,
                b"pong",
            ))
            .unwrap();
        },
        |t| a.recv_match(t, is_error),
    )
    .expect("no ICMP error for the mapped flow's answer");
    let e = guest::parse_icmp_error(&f).unwrap();
    assert_eq!(
        (e.kind, e.inner_src, e.inner_dst),
        ((3, 3), mapped, wsrc),
        "{e:?}"
    );
    assert!(e.checksums_ok, "{e:?}");

    // At least the three (more if a datagram was asked again).
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "icmp_error") >= 3, "{checks:?}");
    drop(env);
}

/// The other way: a guest's ICMP error about a packet of a flow it holds
/// (here: nothing listens on its mapped UDP port) leaves as the node's, so
/// the world's connected socket sees "connection refused" at once instead
/// of waiting; a forged error about a flow the sandbox does not hold is
/// dropped and reaches nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_icmp_error_about_its_flow_reaches_the_world_translated() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let (g, hp) = udp_mapped_raw_guest(&c, "icmp-out").await;
    let mapped = SocketAddrV4::new(world::NODE_IP, hp);
    let sock = world.run(move || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.connect(mapped).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s
    });

    // A forged error first: it quotes a flow with another world port.
    let f = ask(
        || {
            sock.send(b"first").unwrap();
        },
        |t| g.recv_match(t, udp_to_guest_ending(b"first")),
    )
    .expect("the mapped datagram");
    let (world_ip, _, _, _) = guest::parse_ipv4(&f).unwrap();
    let mut forged = f[14..].to_vec();
    let p = u16::from_be_bytes([forged[20], forged[21]]).wrapping_add(1);
    forged[20..22].copy_from_slice(&p.to_be_bytes());
    let unsupported = c.traffic("icmp-out").await["drop_unsupported"];
    g.send(&guest::icmp_error_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP,
        world_ip,
        (3, 3),
        &forged,
    ))
    .unwrap();
    let deadline = std::time::Instant::now() + T;
    while c.traffic("icmp-out").await["drop_unsupported"] == unsupported {
        assert!(
            std::time::Instant::now() < deadline,
            "the forged error was not dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Nobody listens in the guest: port unreachable, quoting what arrived
    // (sent again each second until the world's socket has it: `ask`).
    let f = ask(
        || {
            sock.send(b"anyone home?").unwrap();
        },
        |t| g.recv_match(t, udp_to_guest_ending(b"anyone home?")),
    )
    .expect("the mapped datagram");
    sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let deadline = std::time::Instant::now() + 2 * T;
    let e = loop {
        g.send(&guest::icmp_error_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            GUEST_IP,
            world_ip,
            (3, 3),
            &f[14..],
        ))
        .unwrap();
        let mut b = [0u8; 64];
        match sock.recv(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break e,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the world's socket got no error"
                );
            }
            other => panic!("the world's socket: {other:?}"),
        }
    };
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "icmp_error") >= 1, "{checks:?}");
    drop(env);
}
