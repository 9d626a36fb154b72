//! NAT66 (docs/dual-stack.md) with real kernels on both sides: CNI
//! containers get their IPv6 from the agent's Router Advertisements alone
//! and reach an IPv6 world from the node's address; the default denies
//! hold (the world listens on them: a leak would answer); CIDR rules of
//! both families hold over IPv6 as over IPv4; allowed names reach their
//! AAAA addresses and nothing else; DNS and strict mode go through the
//! agent's resolver and proxy; a sandbox whose rules are IPv4's only or
//! close all IPv6 is refused at once; a connection outlives kill -9.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::Env;
use common::ctr::{Ctr, add};
use common::world::{
    NODE_IP6, Server, WORLD_IP, WORLD_IP6, World, counter, in_netns, tcp_exchange_in,
    udp_exchange_in,
};
use serde_json::json;

/// The cloud metadata service's IPv6 address, and another ULA host: the
/// node routes both to the world, which answers on both.
const METADATA6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);
const ULA_HOST: Ipv6Addr = Ipv6Addr::new(0xfd12, 0x3456, 0, 0, 0, 0, 0, 1);
/// A global address of the world other than `WORLD_IP6`, outside its /64.
const OTHER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x5eed, 0, 0, 0, 0, 7);
/// The SLAAC address of the fixed guest MAC in the guests' prefix.
const GUEST_SLAAC: Ipv6Addr =
    Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0x2290, 0x6fff, 0xfefc, 0xfcfc);
const GATEWAY_LL: &str = "fe80::2290:6fff:fecf:cfcf";
const T: Duration = Duration::from_secs(5);

/// A node facing a world, the agent (re)started after the world is there
/// (the uplink is found at start); `ipv6`: the world also has IPv6 (and
/// these addresses), and the node an IPv6 address and default route.
fn node6(args: &[&str], ipv6: Option<&[Ipv6Addr]>) -> (Env, World) {
    let mut env = Env::new(args);
    let world = World::attach(&env);
    if let Some(more) = ipv6 {
        world.add_ipv6(more);
    }
    env.kill_agent();
    env.start_agent();
    (env, world)
}

fn datapath_detail(checks: &[(String, bool, String)]) -> String {
    checks
        .iter()
        .find(|c| c.0 == "datapath")
        .map(|c| c.2.clone())
        .unwrap_or_default()
}

/// Waits until the container's eth0 has a usable (not tentative) global
/// IPv6 address and, with `route`, an IPv6 default route; how long it took
/// and the address.
fn ready6(ctr: &Ctr, route: bool, within: Duration) -> Option<(Duration, Ipv6Addr)> {
    let t = Instant::now();
    while t.elapsed() < within {
        let addrs = ctr.ip_json(&["-6", "addr", "show", "dev", "eth0", "scope", "global"]);
        let usable = addrs
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .find(|a| a["tentative"].as_bool() != Some(true))
            .and_then(|a| a["local"].as_str().and_then(|s| s.parse().ok()));
        let routed = !route
            || ctr
                .ip_json(&["-6", "route", "show", "default"])
                .as_array()
                .is_some_and(|r| !r.is_empty());
        if let (Some(a), true) = (usable, routed) {
            return Some((t.elapsed(), a));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A world server that echoes every line on one connection (for a
/// connection that must outlive a restart).
fn line_echo(world: &World) -> u16 {
    let any6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0);
    let l = world.run(move || TcpListener::bind(any6).unwrap());
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let mut buf = [0u8; 256];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 || s.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    });
    port
}

/// A far host behind the world, reached through a 1280-byte link (the
/// world routes; the far end's own MTU is 1500, so its MSS does not hide
/// the narrow hop): what the node sends it larger than 1280 bytes meets a
/// Packet Too Big. Deleted on drop.
struct Far {
    ns: String,
}

const FAR_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xfa, 0, 0, 0, 0, 2);

impl Far {
    fn behind(world: &World) -> Far {
        let ns = format!("{}-f", world.ns);
        let sh = |cmd: &str| {
            let ok = std::process::Command::new("sh")
                .args(["-c", cmd])
                .status()
                .unwrap()
                .success();
            assert!(ok, "{cmd}");
        };
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(std::process::Stdio::null())
            .status();
        sh(&format!("ip netns add {ns}"));
        let far = Far { ns: ns.clone() };
        let w = &world.ns;
        sh(&format!(
            "ip -n {w} link add w1 mtu 1280 type veth peer name f0 mtu 1500 netns {ns} && \
             ip netns exec {w} sysctl -qw net.ipv6.conf.all.forwarding=1 && \
             ip -n {w} addr add 2001:db8:fa::1/64 dev w1 nodad && ip -n {w} link set w1 up && \
             ip -n {ns} addr add {FAR_IP6}/64 dev f0 nodad && ip -n {ns} link set f0 up && \
             ip -n {ns} link set lo up && ip -n {ns} -6 route add default via 2001:db8:fa::1"
        ));
        far
    }
}

impl Drop for Far {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> Result<Vec<u8>, String> {
    s.write_all(msg).map_err(|e| format!("write: {e}"))?;
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf).map_err(|e| format!("read: {e}"))?;
    Ok(buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nat66_carries_open_sandboxes_to_the_ipv6_world_and_nothing_else() {
    require_root!();
    let (mut env, world) = node6(&[], Some(&[METADATA6, ULA_HOST]));
    let c = env.client().await;
    let (_, checks) = c.health().await;
    let dp = datapath_detail(&checks);
    assert!(dp.contains(&format!("ipv6=nat66 via {NODE_IP6}")), "{dp}");

    let open = Ctr::new("v6open");
    let r = add(&env, "open", &open, json!({}));
    // Its result: both families, the IPv6 default route included.
    assert_eq!(
        r["routes"][1],
        json!({"dst": "::/0", "gw": GATEWAY_LL}),
        "{r}"
    );
    // The container has both families when ADD returns: the SLAAC address
    // and, from the RA, the default route.
    let at_once = ready6(&open, true, Duration::from_millis(1));
    assert_eq!(
        at_once.map(|r| r.1),
        Some(GUEST_SLAAC),
        "{}",
        open.sh("ip -6 addr; ip -6 route")
    );
    let ruled = Ctr::new("v6rules");
    // Rules of IPv4 CIDRs only were written for IPv4: IPv4-only.
    let r = add(
        &env,
        "ruled",
        &ruled,
        json!({"denyOut": ["203.0.113.5/32"]}),
    );
    assert_eq!(r["ips"].as_array().unwrap().len(), 4, "{r}");
    assert_eq!(r["routes"].as_array().unwrap().len(), 1, "{r}");
    // GetNetwork says whose IPv6 reaches the world.
    for (id, want) in [("cni:open:eth0", true), ("cni:ruled:eth0", false)] {
        let net = c.get(id).await.unwrap();
        let v = bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap();
        assert_eq!(v, want, "{id}");
    }

    // The SLAAC address of the guest MAC (cube-cni adds it; a VM guest's
    // comes from the RA alone: tests/vm) and a default route via the
    // gateway (from the RA).
    let Some((took, addr)) = ready6(&open, true, Duration::from_secs(10)) else {
        panic!(
            "no usable IPv6 address and default route from the agent's RAs: {}",
            open.sh("ip -6 addr; ip -6 route; ip link; sysctl -a 2>/dev/null | grep -E 'eth0.(accept_ra|forwarding|disable_ipv6|addr_gen)'")
        );
    };
    eprintln!("usable IPv6 address and default route {took:?} after ADD");
    assert_eq!(addr, GUEST_SLAAC);
    let route = open.ip_json(&["-6", "route", "show", "default"]);
    assert_eq!(route[0]["gateway"].as_str(), Some(GATEWAY_LL), "{route}");

    // TCP, UDP and echo to the world, all from the node's address.
    let tport = world.tcp_server6(0);
    let uport = world.udp_echo6(0);
    let got = tcp_exchange_in(
        &open.name,
        SocketAddr::new(WORLD_IP6.into(), tport),
        b"over tcp6",
        T,
    );
    let Ok(got) = got else {
        let (_, checks) = c.health().await;
        panic!("{got:?}: {}", datapath_detail(&checks));
    };
    assert_eq!(got, b"world:over tcp6");
    let got = udp_exchange_in(
        &open.name,
        SocketAddr::new(WORLD_IP6.into(), uport),
        b"over udp6",
        T,
    )
    .unwrap();
    assert_eq!(got, b"world:over udp6");
    let ping = open.sh(&format!(
        "busybox ping -6 -c 1 -W 3 {WORLD_IP6} && echo PONG"
    ));
    assert!(ping.contains("PONG"), "{ping}");
    let seen: Vec<SocketAddr> = world
        .peers(tport)
        .into_iter()
        .chain(world.peers(uport))
        .collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for p in &seen {
        assert_eq!(
            p.ip(),
            IpAddr::V6(NODE_IP6),
            "NAT66: the world sees the node: {seen:?}"
        );
        assert!(p.port() >= 1024, "{seen:?}");
    }

    // The default denies: the metadata address and a ULA host are never
    // reached, though the world answers on both.
    let (_, checks) = c.health().await;
    let denied_before = counter(&checks, "policy_drop");
    for dst in [METADATA6, ULA_HOST] {
        let r = tcp_exchange_in(
            &open.name,
            SocketAddr::new(dst.into(), tport),
            b"leak",
            Duration::from_millis(1500),
        );
        assert!(r.is_err(), "{dst} reached: {r:?}");
    }
    assert_eq!(world.peers(tport).len(), 1, "{:?}", world.peers(tport));
    let (_, checks) = c.health().await;
    assert!(
        counter(&checks, "policy_drop") >= denied_before + 2,
        "{checks:?}"
    );
    assert!(counter(&checks, "nat66") >= 3, "{checks:?}");
    assert!(counter(&checks, "nat66_reply") >= 3, "{checks:?}");
    // Per family: the sandbox's counters are totals with their IPv6 part
    // beside them. Three IPv6 flows (TCP, UDP, echo) and the denied SYNs
    // (each connection's first and its retransmits) so far, then an IPv4
    // flow: only the total moves.
    let t = c.traffic("cni:open:eth0").await;
    assert_eq!(t["new_flows_snat_ipv6"], 3, "{t:?}");
    assert_eq!(t["new_flows_snat"], 3, "{t:?}");
    assert!(t["drop_policy_ipv6"] >= 2, "{t:?}");
    assert_eq!(t["drop_policy"], t["drop_policy_ipv6"], "{t:?}");
    let echo4 = world.udp_echo(0);
    udp_exchange_in(&open.name, echo4, b"over udp4", T).unwrap();
    let t = c.traffic("cni:open:eth0").await;
    assert_eq!(t["new_flows_snat"], 4, "{t:?}");
    assert_eq!(t["new_flows_snat_ipv6"], 3, "{t:?}");
    // Bytes and packets per family: five 1000-byte datagrams over IPv6 and
    // their echoes move the IPv6 part by at least their frames (Ethernet,
    // IPv6 and UDP headers; the echo adds "world:"); five over IPv4 move
    // the totals, and the IPv6 part by no more than the link's own chatter
    // (neighbour discovery).
    let big = [b'x'; 1000];
    let frame6 = 14 + 40 + 8 + 1000;
    let frame4 = 14 + 20 + 8 + 1000;
    let moved = |a: &std::collections::BTreeMap<String, u64>,
                 b: &std::collections::BTreeMap<String, u64>,
                 k: &str| b[k] - a[k];
    let t0 = c.traffic("cni:open:eth0").await;
    for _ in 0..5 {
        udp_exchange_in(
            &open.name,
            SocketAddr::new(WORLD_IP6.into(), uport),
            &big,
            T,
        )
        .unwrap();
    }
    let t1 = c.traffic("cni:open:eth0").await;
    assert!(
        moved(&t0, &t1, "tx_bytes_ipv6") >= 5 * frame6,
        "{t0:?} {t1:?}"
    );
    assert!(
        moved(&t0, &t1, "rx_bytes_ipv6") >= 5 * (frame6 + 6),
        "{t0:?} {t1:?}"
    );
    assert!(moved(&t0, &t1, "tx_packets_ipv6") >= 5, "{t1:?}");
    assert!(moved(&t0, &t1, "rx_packets_ipv6") >= 5, "{t1:?}");
    for k in ["tx_bytes", "rx_bytes", "tx_packets", "rx_packets"] {
        assert!(t1[&format!("{k}_ipv6")] <= t1[k], "{k}: {t1:?}");
    }
    for _ in 0..5 {
        udp_exchange_in(&open.name, echo4, &big, T).unwrap();
    }
    let t2 = c.traffic("cni:open:eth0").await;
    assert!(moved(&t1, &t2, "tx_bytes") >= 5 * frame4, "{t1:?} {t2:?}");
    assert!(
        moved(&t1, &t2, "rx_bytes") >= 5 * (frame4 + 6),
        "{t1:?} {t2:?}"
    );
    assert!(moved(&t1, &t2, "tx_bytes_ipv6") < 500, "{t1:?} {t2:?}");
    assert!(moved(&t1, &t2, "rx_bytes_ipv6") < 500, "{t1:?} {t2:?}");
    // And in the metrics, a family of its own beside the totals (each
    // datagram above came from a socket of its own: ten more flows, five
    // of them IPv6).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cubenetctl"))
        .arg("metrics")
        .env(
            "CUBENETCTL_REPORT",
            env.dir.join("report/org.cube.NetworkAgent"),
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "cube_network_agent_sandbox_new_flows_total{sandbox_id=\"cni:open:eth0\",kind=\"snat\"} 14",
        "cube_network_agent_sandbox_ipv6_new_flows_total{sandbox_id=\"cni:open:eth0\",kind=\"snat\"} 8",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }
    let v6_bytes = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "cube_network_agent_sandbox_ipv6_bytes_total{sandbox_id=\"cni:open:eth0\",direction=\"tx\"} ",
            )
        })
        .and_then(|v| v.parse::<u64>().ok());
    assert!(
        v6_bytes.is_some_and(|v| v >= t1["tx_bytes_ipv6"]),
        "{v6_bytes:?}:\n{text}"
    );

    // IPv4 rules only: no default route in the RA, and a static one meets
    // a refusal at once; the world sees nobody.
    let (_, raddr) = ready6(&ruled, false, Duration::from_secs(10)).expect("no SLAAC address");
    assert_eq!(raddr, GUEST_SLAAC);
    std::thread::sleep(Duration::from_millis(300));
    let r = ruled.ip_json(&["-6", "route", "show", "default"]);
    assert!(r.as_array().is_none_or(|r| r.is_empty()), "{r}");
    ruled.sh(&format!(
        "ip -6 route add default via {GATEWAY_LL} dev eth0"
    ));
    let t = Instant::now();
    let r = tcp_exchange_in(
        &ruled.name,
        SocketAddr::new(WORLD_IP6.into(), tport),
        b"ruled",
        Duration::from_secs(3),
    );
    let refused_in = t.elapsed();
    assert!(r.as_ref().is_err_and(|e| e.contains("refused")), "{r:?}");
    assert!(refused_in < Duration::from_millis(500), "{refused_in:?}");
    assert_eq!(world.peers(tport).len(), 1, "{:?}", world.peers(tport));

    // Path MTU: an upload to a host behind a 1280-byte hop completes
    // only if the hop's Packet Too Big reaches the container, translated.
    let far = Far::behind(&world);
    let far_server = Server::tcp(
        &far.ns,
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
        b"far:",
    );
    let big = vec![b'x'; 100_000];
    let (_, checks) = c.health().await;
    let errors_before = counter(&checks, "icmp_error");
    let got = tcp_exchange_in(
        &open.name,
        SocketAddr::new(FAR_IP6.into(), far_server.addr.port()),
        &big,
        Duration::from_secs(10),
    );
    let (_, checks) = c.health().await;
    let got = got.unwrap_or_else(|e| panic!("{e}: {}", datapath_detail(&checks)));
    assert_eq!(got.len(), 4 + big.len());
    assert!(counter(&checks, "icmp_error") > errors_before, "{checks:?}");
    let pmtu = open.sh(&format!("ip -6 route get {FAR_IP6}"));
    assert!(pmtu.contains("mtu 1280"), "{pmtu}");
    drop(far_server);
    drop(far);

    // kill -9 and restart: the connection goes on (pinned flow tables).
    let eport = line_echo(&world);
    let mut s = in_netns(&open.name, move || {
        TcpStream::connect_timeout(&SocketAddr::new(WORLD_IP6.into(), eport), T).unwrap()
    });
    s.set_read_timeout(Some(T)).unwrap();
    assert_eq!(roundtrip(&mut s, b"before").unwrap(), b"before");
    env.kill_agent();
    assert_eq!(roundtrip(&mut s, b"agent down").unwrap(), b"agent down");
    env.start_agent();
    let c = env.client().await;
    assert_eq!(roundtrip(&mut s, b"after").unwrap(), b"after");
    let (_, checks) = c.health().await;
    assert!(
        datapath_detail(&checks).contains("ipv6=nat66"),
        "{checks:?}"
    );
}

/// The IPv4 policy tests (tests/datapath.rs
/// `egress_policy_and_changes_apply_to_new_flows`, the allow-lists of
/// tests/egress.rs) over IPv6, each case a container with its own rules:
/// a deny CIDR drops, an allow CIDR beats it, an allow-list (the catch-all
/// deny) closes everything else of both families, a unique-local host is
/// reached only under an allow CIDR and the metadata address never, not
/// even under ::/0; rules that leave no IPv6 open (an IPv4 allow-list,
/// IPv4 CIDRs only, the IPv6 catch-all, no internet) give no IPv6 route
/// and a refusal at once, and ::/0 denied closes IPv4 too. The world answers on every address it
/// is asked for: each connection it sees must be one the rules allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_cidr_rules_hold_as_the_ipv4_ones_with_no_leak() {
    require_root!();
    let (env, world) = node6(&[], Some(&[METADATA6, ULA_HOST, OTHER6]));
    let c = env.client().await;
    let port = world.tcp_server6(0);
    let w6 = WORLD_IP6.to_string();
    let ula = format!("{ULA_HOST}");
    // (container, CNI rules, IPv6 open, [(destination, reached)])
    let v4 = IpAddr::V4(WORLD_IP);
    let cases = [
        (
            "deny",
            json!({"denyOut": ["2001:db8::/32"], "allowOut": [w6]}),
            true,
            vec![
                (IpAddr::V6(WORLD_IP6), true),
                (IpAddr::V6(OTHER6), false),
                (IpAddr::V6(METADATA6), false),
                (IpAddr::V6(ULA_HOST), false),
                (v4, true),
            ],
        ),
        (
            "list6",
            json!({"denyOut": ["0.0.0.0/0"], "allowOut": [w6, ula]}),
            true,
            vec![
                (IpAddr::V6(WORLD_IP6), true),
                (IpAddr::V6(ULA_HOST), true),
                (IpAddr::V6(OTHER6), false),
                (IpAddr::V6(METADATA6), false),
                (v4, false),
            ],
        ),
        (
            "list4",
            json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["198.51.100.0/24"]}),
            false,
            vec![(IpAddr::V6(WORLD_IP6), false), (v4, true)],
        ),
        // Rules of IPv4 CIDRs only were written for IPv4: a service denied
        // by its IPv4 address must not be reached by its IPv6 one.
        (
            "deny4",
            json!({"denyOut": ["203.0.113.0/24"]}),
            false,
            vec![(IpAddr::V6(WORLD_IP6), false), (v4, true)],
        ),
        // "All IPv6" allowed: every unique-local host but the metadata
        // address, which no allow CIDR opens.
        (
            "all6",
            json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["::/0"]}),
            true,
            vec![
                (IpAddr::V6(WORLD_IP6), true),
                (IpAddr::V6(ULA_HOST), true),
                (IpAddr::V6(METADATA6), false),
                (v4, false),
            ],
        ),
        (
            "deny6all",
            json!({"denyOut": ["::/0"]}),
            false,
            vec![(IpAddr::V6(WORLD_IP6), false), (v4, false)],
        ),
        (
            "offline",
            json!({"allowInternetAccess": false}),
            false,
            vec![(IpAddr::V6(WORLD_IP6), false), (v4, false)],
        ),
    ];
    let ctrs: Vec<Ctr> = cases
        .iter()
        .map(|(name, rules, _, _)| {
            let ctr = Ctr::new(&format!("v6p{name}"));
            add(&env, name, &ctr, rules.clone());
            ctr
        })
        .collect();
    let (_, checks) = c.health().await;
    let denied_before = counter(&checks, "policy_drop");
    let mut reached = 0;
    let mut dropped = 0;
    for ((name, _, open, dsts), ctr) in cases.iter().zip(&ctrs) {
        let net = c.get(&format!("cni:{name}:eth0")).await.unwrap();
        let v = bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap();
        assert_eq!(v, *open, "{name}: ipv6_egress");
        let Some(_) = ready6(ctr, *open, Duration::from_secs(10)) else {
            panic!(
                "{name}: no IPv6 address{}: {}",
                if *open { " and route" } else { "" },
                ctr.sh("ip -6 addr; ip -6 route")
            );
        };
        if !*open {
            // No route from the RAs; a static one meets a refusal at once.
            std::thread::sleep(Duration::from_millis(300));
            let r = ctr.ip_json(&["-6", "route", "show", "default"]);
            assert!(r.as_array().is_none_or(|r| r.is_empty()), "{name}: {r}");
            ctr.sh(&format!(
                "ip -6 route add default via {GATEWAY_LL} dev eth0"
            ));
        }
        for (dst, want) in dsts {
            let t = Instant::now();
            let r = tcp_exchange_in(
                &ctr.name,
                SocketAddr::new(*dst, port),
                b"rule",
                Duration::from_millis(1500),
            );
            if *want {
                assert_eq!(r.as_deref(), Ok(&b"world:rule"[..]), "{name} -> {dst}");
                reached += 1;
                continue;
            }
            assert!(r.is_err(), "{name} -> {dst} reached: {r:?}");
            if dst.is_ipv6() && !*open {
                let e = r.unwrap_err();
                assert!(e.contains("refused"), "{name} -> {dst}: {e}");
                assert!(
                    t.elapsed() < Duration::from_millis(500),
                    "{name}: {:?}",
                    t.elapsed()
                );
            } else {
                dropped += 1;
            }
        }
    }
    // No leak: the world saw exactly the allowed connections, each from
    // the node's address.
    let peers = world.peers(port);
    assert_eq!(peers.len(), reached, "{peers:?}");
    for p in &peers {
        let from = match p.ip() {
            IpAddr::V6(a) => a.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(a)),
            a => a,
        };
        assert!(
            from == IpAddr::V6(NODE_IP6) || from == IpAddr::V4(common::world::NODE_IP),
            "{peers:?}"
        );
    }
    let (_, checks) = c.health().await;
    assert!(
        counter(&checks, "policy_drop") >= denied_before + dropped,
        "{dropped} drops expected: {checks:?}"
    );
}

/// The node's own addresses are not the world: a sandbox with NAT66 never
/// reaches a service of the node on the uplink's IPv6 address (nor, as
/// ever, on its IPv4 one) — host ↔ sandbox goes through the gateway and
/// its admission only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_own_addresses_are_not_the_world() {
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let host = Server::tcp(
        &env.ns,
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
        b"host:",
    );
    let port = host.addr.port();
    let open = Ctr::new("v6host");
    add(&env, "host", &open, json!({}));
    ready6(&open, true, Duration::from_secs(10)).expect("no IPv6 route");
    // With forwarding off (the kernel routes what the datapath hands it)
    // and on (the datapath's own route lookup says "local").
    for forwarding in ["0", "1"] {
        for (key, dst) in [
            ("net.ipv6.conf.all.forwarding", IpAddr::V6(NODE_IP6)),
            ("net.ipv4.ip_forward", IpAddr::V4(common::world::NODE_IP)),
        ] {
            env.ns_cmd(&["sysctl", "-qw", &format!("{key}={forwarding}")]);
            let r = tcp_exchange_in(
                &open.name,
                SocketAddr::new(dst, port),
                b"in",
                Duration::from_millis(1500),
            );
            assert!(
                r.is_err(),
                "forwarding {forwarding}: the node's {dst} reached: {r:?}"
            );
        }
    }
    assert!(host.peers().is_empty(), "{:?}", host.peers());
    // The world still answers with forwarding on (the datapath's own
    // next-hop lookup, where the other tests leave it to the kernel).
    let wport = world.tcp_server6(0);
    let got = tcp_exchange_in(
        &open.name,
        SocketAddr::new(WORLD_IP6.into(), wport),
        b"fwd",
        T,
    );
    assert_eq!(got.as_deref(), Ok(&b"world:fwd"[..]));
}

/// Domain rules over IPv6 (tests/egress.rs over IPv4): an allowed name's
/// AAAA answer is learned before it reaches the container, so `curl -6`
/// by name connects, and the address is reachable only after the lookup;
/// a deny CIDR beats a learned address; a unique-local answer (the
/// metadata address) is never learned; a name not allowed is REFUSED;
/// DNS-over-TLS to the world over IPv6 never leaves; what was learned
/// survives kill -9. The world counts its peers: each one allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_names_reach_their_ipv6_addresses_and_nothing_else() {
    require_root!();
    let (mut env, world) = node6(
        &["--dns-upstream", "198.51.100.2"],
        Some(&[METADATA6, OTHER6]),
    );
    let _dns = common::dnsmasq::start(
        &world,
        &[
            format!("--host-record=ds.allowed.test,{WORLD_IP},{WORLD_IP6}"),
            format!("--host-record=other.allowed.test,{OTHER6}"),
            format!("--host-record=meta.allowed.test,{METADATA6}"),
            format!("--host-record=www.denied.test,{WORLD_IP6}"),
            // Longer than the test: the restart must not outlast it.
            "--local-ttl=300".to_string(),
        ],
        "ds.allowed.test",
    );
    let c = env.client().await;
    let ctr = Ctr::new("v6names");
    add(
        &env,
        "names",
        &ctr,
        json!({
            "allowOut": ["*.allowed.test"],
            "denyOut": ["0.0.0.0/0", "2001:db8:5eed::/48"],
        }),
    );
    let net = c.get("cni:names:eth0").await.unwrap();
    assert!(bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap());
    ready6(&ctr, true, Duration::from_secs(10)).expect("no IPv6 address and route");
    let _conf = ctr.resolv_conf("169.254.68.5");
    let port = world.tcp_server6(0);
    let dot = world.tcp_server6(853);
    let short = Duration::from_millis(1500);
    let to = |ip: Ipv6Addr, p: u16| SocketAddr::new(ip.into(), p);

    // Not looked up yet: closed.
    let r = tcp_exchange_in(&ctr.name, to(WORLD_IP6, port), b"early", short);
    assert!(r.is_err(), "reached before any lookup: {r:?}");
    // By name, over IPv6, with real clients.
    let dig = |q: &str| ctr.sh(&format!("dig +time=1 +tries=1 {q} 2>&1"));
    let out = dig("AAAA ds.allowed.test");
    assert!(
        out.contains("status: NOERROR") && out.contains(&WORLD_IP6.to_string()),
        "{out}"
    );
    let out = ctr.sh(&format!(
        "curl -6 -s --http0.9 --connect-timeout 2 --max-time 5 http://ds.allowed.test:{port}/ 2>&1; echo \" rc=$?\""
    ));
    assert!(
        out.starts_with("world:GET /") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    assert_eq!(
        tcp_exchange_in(&ctr.name, to(WORLD_IP6, port), b"by addr", T).as_deref(),
        Ok(&b"world:by addr"[..])
    );
    // Answered, never learned: a deny CIDR's address, a unique-local one.
    for (name, ip) in [
        ("other.allowed.test", OTHER6),
        ("meta.allowed.test", METADATA6),
    ] {
        let out = dig(&format!("AAAA {name}"));
        assert!(out.contains(&ip.to_string()), "{out}");
        let r = tcp_exchange_in(&ctr.name, to(ip, port), b"leak", short);
        assert!(r.is_err(), "{name} ({ip}) reached: {r:?}");
    }
    let out = dig("AAAA www.denied.test");
    assert!(out.contains("status: REFUSED"), "{out}");
    // DNS-over-TLS past the agent's resolver, to a learned address.
    let r = tcp_exchange_in(&ctr.name, to(WORLD_IP6, dot), b"dot", short);
    assert!(r.is_err(), "DNS-over-TLS over IPv6 left: {r:?}");
    assert!(world.peers(dot).is_empty());
    // kill -9: what was learned stays in force.
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    assert_eq!(
        tcp_exchange_in(&ctr.name, to(WORLD_IP6, port), b"after", T).as_deref(),
        Ok(&b"world:after"[..])
    );
    let peers = world.peers(port);
    assert_eq!(
        peers.len(),
        3,
        "curl, by address, after the restart: {peers:?}"
    );
    assert!(
        peers.iter().all(|p| p.ip() == IpAddr::V6(NODE_IP6)),
        "{peers:?}"
    );
    let (_, checks) = c.health().await;
    assert!(
        datapath_detail(&checks).contains("ipv6=nat66"),
        "{checks:?}"
    );
}

/// A node without IPv6 egress, a dual-stack name: the container asks for
/// both families (curl does Happy Eyeballs), is told there is no IPv6
/// address, and connects over IPv4 at once (the bound: 300 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ipv6_egress_a_dual_stack_name_goes_over_ipv4_at_once() {
    require_root!();
    let (env, world) = node6(&["--dns-upstream", "198.51.100.2"], None);
    let _dns = common::dnsmasq::start(
        &world,
        &[
            format!("--host-record=ds.allowed.test,{WORLD_IP},{WORLD_IP6}"),
            "--local-ttl=300".to_string(),
        ],
        "ds.allowed.test",
    );
    let c = env.client().await;
    let (_, checks) = c.health().await;
    assert!(datapath_detail(&checks).contains("ipv6=link"), "{checks:?}");
    let web = world.tcp_server(0);
    for (id, rules) in [
        ("plain", json!({})),
        (
            "named",
            json!({"allowOut": ["*.allowed.test"], "denyOut": ["0.0.0.0/0"]}),
        ),
    ] {
        let ctr = Ctr::new(&format!("v6he{id}"));
        add(&env, id, &ctr, rules);
        ready6(&ctr, false, Duration::from_secs(10)).expect("no IPv6 address");
        let _conf = ctr.resolv_conf("169.254.68.5");
        let out = ctr.sh(&format!(
            "curl -s --http0.9 -o /dev/null -w '%{{time_connect}} %{{remote_ip}}' \
             --connect-timeout 3 --max-time 5 http://ds.allowed.test:{}/ 2>&1",
            web.port()
        ));
        let mut f = out.split_whitespace();
        let (took, ip) = (f.next().and_then(|t| t.parse::<f64>().ok()), f.next());
        eprintln!("{id}: dual-stack name connected over {ip:?} in {took:?} s");
        assert_eq!(ip, Some(WORLD_IP.to_string().as_str()), "{id}: {out}");
        assert!(took.is_some_and(|t| t < 0.3), "{id}: {out}");
    }
}

/// The node's IPv6 egress followed live (no restart): the uplink gains an
/// IPv6 address and default route, and within moments Health says NAT66,
/// GetNetwork says so, and a running container gets its default route by
/// an RA the agent sends (a running Linux guest never solicits again) and
/// reaches the world; the default route goes, and the container's goes
/// with it, its IPv6 refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uplinks_ipv6_is_followed_live_and_guests_are_told() {
    require_root!();
    // Started with the IPv4 uplink (found at start), without IPv6.
    let (env, world) = node6(&[], None);
    let c = env.client().await;
    let (_, checks) = c.health().await;
    assert!(datapath_detail(&checks).contains("ipv6=link"), "{checks:?}");
    let ctr = Ctr::new("v6live");
    add(&env, "live", &ctr, json!({}));
    ready6(&ctr, false, Duration::from_secs(10)).expect("no SLAAC address");
    let egress = |c: &common::Client| {
        let c = c.clone();
        async move {
            let net = c.get("cni:live:eth0").await.unwrap();
            bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap()
        }
    };
    assert!(!egress(&c).await);
    let port = world.tcp_server6(0);

    // IPv6 egress appears.
    world.add_ipv6(&[]);
    let t = Instant::now();
    let Some((took, _)) = ready6(&ctr, true, Duration::from_secs(5)) else {
        let (_, checks) = c.health().await;
        panic!("no default route from the agent's RA: {checks:?}");
    };
    eprintln!("default route {took:?} after the uplink got IPv6");
    let (_, checks) = c.health().await;
    assert!(
        datapath_detail(&checks).contains(&format!("ipv6=nat66 via {NODE_IP6}")),
        "{checks:?}"
    );
    assert!(egress(&c).await);
    let got = tcp_exchange_in(
        &ctr.name,
        SocketAddr::new(WORLD_IP6.into(), port),
        b"live",
        T,
    );
    assert_eq!(got.as_deref(), Ok(&b"world:live"[..]));
    assert!(t.elapsed() < Duration::from_secs(5));

    // The default route goes: so does the container's, by the next RA.
    env.ns_cmd(&["ip", "-6", "route", "del", "default"]);
    let t = Instant::now();
    loop {
        let r = ctr.ip_json(&["-6", "route", "show", "default"]);
        if r.as_array().is_none_or(|r| r.is_empty()) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the route stayed: {r}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "default route withdrawn {:?} after the uplink's went",
        t.elapsed()
    );
    let (_, checks) = c.health().await;
    assert!(datapath_detail(&checks).contains("ipv6=link"), "{checks:?}");
    assert!(!egress(&c).await);
    // A static route now meets a refusal at once.
    ctr.sh(&format!(
        "ip -6 route add default via {GATEWAY_LL} dev eth0"
    ));
    let t = Instant::now();
    let r = tcp_exchange_in(
        &ctr.name,
        SocketAddr::new(WORLD_IP6.into(), port),
        b"gone",
        T,
    );
    assert!(r.as_ref().is_err_and(|e| e.contains("refused")), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(world.peers(port).len(), 1, "{:?}", world.peers(port));
}

/// Port mappings over IPv6 (a mapping on every node address covers the
/// uplink's IPv6 address): the world reaches a container's mapped TCP and
/// UDP ports on the node's IPv6 address, the container sees the client's
/// own address, and its replies leave from the mapped port although its
/// policy denies the client's network (replies of flows the world opened
/// are not egress); a host socket bound on the host port after ADD gets
/// none of them (a CNI attachment's mappings win, `mapping_wins`); ICMPv6
/// errors about mapped flows are translated both ways (a Packet Too Big to
/// the container, its port unreachable to the client); a
/// sandbox whose IPv6 does not reach the world (its guest has no route
/// back) is mapped over IPv4 only, and an IPv6 client is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_mappings_reach_containers_over_ipv6() {
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let c = env.client().await;
    let pm = |h: u16, ctr: u16, proto: &str| mapping(h, ctr, proto, "");
    let open = Ctr::new("v6pm");
    add(
        &env,
        "pm",
        &open,
        json!({
            "denyOut": ["2001:db8::/32", "198.51.100.0/24"],
            "runtimeConfig": {"portMappings": [
                pm(20180, 8080, "tcp"), pm(20181, 8081, "udp"), pm(20182, 8082, "tcp"),
                pm(20184, 8084, "tcp"), pm(20185, 8085, "udp")]},
        }),
    );
    let closed = Ctr::new("v6pmc");
    add(
        &env,
        "pmc",
        &closed,
        json!({
            "denyOut": ["0.0.0.0/0"],
            "runtimeConfig": {"portMappings": [pm(20183, 8080, "tcp")]},
        }),
    );
    ready6(&open, true, Duration::from_secs(10)).expect("no IPv6 address and route");
    let any6 = |p: u16| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), p);
    let tcp = Server::tcp(&open.name, any6(8080), b"ctr:");
    let udp = Server::udp(&open.name, any6(8081), b"ctr:");
    let _shadowed = Server::tcp(&open.name, any6(8082), b"ctr:");
    let host = Server::tcp(&env.ns, any6(20182), b"host:");
    let closed_srv = Server::tcp(&closed.name, any6(8080), b"closed:");
    let node = |p: u16| SocketAddr::new(NODE_IP6.into(), p);

    let got = tcp_exchange_in(&world.ns, node(20180), b"tcp6", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:tcp6"[..]));
    let got = udp_exchange_in(&world.ns, node(20181), b"udp6", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:udp6"[..]));
    for p in tcp.peers().iter().chain(&udp.peers()) {
        assert_eq!(p.ip(), IpAddr::V6(WORLD_IP6), "the client's own address");
    }
    let t = c.traffic("cni:pm:eth0").await;
    assert_eq!(t["new_flows_portmap_ipv6"], 2, "{t:?}");
    assert_eq!(t["new_flows_portmap"], 2, "{t:?}");
    // A CNI attachment's mapping wins over a host socket bound on its
    // port after ADD (mapping_wins: a runtime's reservation, as podman's
    // conmon holds; docs/datapath.md "Host-facing surface").
    let got = tcp_exchange_in(&world.ns, node(20182), b"x", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:x"[..]));
    assert!(host.peers().is_empty());

    // ICMPv6 errors about mapped flows, both ways. In: a client behind a
    // 1280-byte hop gets a large answer only if the hop's Packet Too Big
    // (about the node's address and host port) reaches the container,
    // translated. Out: the container's "port unreachable" (no socket on
    // the mapped UDP port) reaches the client as the node's, at once.
    let big = Server::tcp(&open.name, any6(8084), &vec![b'y'; 200_000]);
    let far = Far::behind(&world);
    let (_, checks) = c.health().await;
    let errors_before = counter(&checks, "icmp_error");
    let got = tcp_exchange_in(&far.ns, node(20184), b"go", Duration::from_secs(10));
    let (_, checks) = c.health().await;
    let got = got.unwrap_or_else(|e| panic!("{e}: {}", datapath_detail(&checks)));
    assert_eq!(got.len(), 200_002);
    assert_eq!(big.peers()[0].ip(), IpAddr::V6(FAR_IP6));
    let pmtu = open.sh(&format!("ip -6 route get {FAR_IP6}"));
    assert!(pmtu.contains("mtu 1280"), "{pmtu}");
    drop((big, far));
    let errors_in = counter(&checks, "icmp_error");
    assert!(errors_in > errors_before, "{checks:?}");
    let refused = world.run(move || {
        let s = std::net::UdpSocket::bind("[::]:0").unwrap();
        s.connect(SocketAddr::new(NODE_IP6.into(), 20185)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.send(b"anyone?").unwrap();
        let t = Instant::now();
        (s.recv(&mut [0u8; 64]).map_err(|e| e.kind()), t.elapsed())
    });
    assert_eq!(
        refused.0,
        Err(std::io::ErrorKind::ConnectionRefused),
        "{refused:?}"
    );
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "icmp_error") > errors_in, "{checks:?}");

    // IPv6 closed: refused at once over IPv6, mapped over IPv4.
    let t = Instant::now();
    let r = tcp_exchange_in(&world.ns, node(20183), b"v6", T);
    assert!(r.as_ref().is_err_and(|e| e.contains("refused")), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    let got = tcp_exchange_in(
        &world.ns,
        SocketAddr::new(common::world::NODE_IP.into(), 20183),
        b"v4",
        T,
    );
    assert_eq!(got.as_deref(), Ok(&b"closed:v4"[..]));
    assert_eq!(closed_srv.peers().len(), 1);
    let (_, checks) = c.health().await;
    assert!(counter(&checks, "portmap") >= 4, "{checks:?}");
    assert_eq!(counter(&checks, "portmap_host_socket"), 0, "{checks:?}");

    // A flow the world opened keeps its exemption from the egress policy
    // only while its mapping lasts: the container sends to the client
    // from its mapped port, then a converge removes the mapping.
    let client = world.run(|| {
        let s = std::net::UdpSocket::bind("[::]:0").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        s
    });
    // The same over IPv4 (the mapping is on every node address; the
    // container's rules deny the world's IPv4 network too).
    let client4 = world.run(|| {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        s
    });
    let node4 = SocketAddr::new(common::world::NODE_IP.into(), 20181);
    let mut buf = [0u8; 64];
    for (cl, to) in [(&client, node(20181)), (&client4, node4)] {
        cl.send_to(b"open", to).unwrap();
        let (n, _) = cl.recv_from(&mut buf).expect("the mapped reply");
        assert_eq!(&buf[..n], b"ctr:open", "{to}");
    }
    drop(udp);
    let (cport, cport4) = (
        client.local_addr().unwrap().port(),
        client4.local_addr().unwrap().port(),
    );
    let send_from_mapped_port = |what: &str| {
        open.sh(&format!(
            "python3 -c \"import socket; s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); \
             s.bind(('::', 8081)); s.sendto(b'{what}', ('{WORLD_IP6}', {cport})); s.close(); \
             s4=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
             s4.bind(('0.0.0.0', 8081)); s4.sendto(b'{what}', ('{WORLD_IP}', {cport4}))\""
        ))
    };
    send_from_mapped_port("still");
    for cl in [&client, &client4] {
        let (n, _) = cl
            .recv_from(&mut buf)
            .expect("the flow's packets while mapped");
        assert_eq!(&buf[..n], b"still");
    }
    // The same attachment (as tests/bandwidth.rs converges one), its
    // metadata and rules kept, without the UDP mapping.
    use zbus::zvariant::Value;
    let net = c.get("cni:pm:eth0").await.unwrap();
    let netns = std::fs::File::open(open.path()).unwrap();
    let mut o = common::opts(vec![
        ("attach", Value::from("veth")),
        ("ifname", Value::from("eth0")),
        (
            "netns_fd",
            Value::from(zbus::zvariant::Fd::from(std::os::fd::AsFd::as_fd(&netns))),
        ),
        (
            "deny_out",
            Value::from(vec![
                "2001:db8::/32".to_string(),
                "198.51.100.0/24".to_string(),
            ]),
        ),
        (
            "port_mappings",
            common::ports(&[("tcp", 8080, 20180, ""), ("tcp", 8082, 20182, "")]),
        ),
    ]);
    o.insert("metadata".into(), net["metadata"].try_clone().unwrap());
    c.ensure("cni:pm:eth0", o)
        .await
        .expect("converge without the UDP mapping");
    send_from_mapped_port("late");
    for cl in [&client, &client4] {
        let r = cl.recv_from(&mut buf);
        assert!(r.is_err(), "sent after its mapping was removed: {r:?}");
    }
}

/// `cmd` in namespace `ns` as uid `uid` (or root); its exit status and
/// output.
fn sh_as(ns: &str, uid: Option<u32>, cmd: &str) -> (bool, String) {
    let mut c = std::process::Command::new("ip");
    c.args(["netns", "exec", ns]);
    if let Some(uid) = uid {
        c.arg("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg("--clear-groups");
    }
    let out = c.args(["sh", "-c", cmd]).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Host <-> sandbox over IPv6 (docs/dual-stack.md): the node reaches a
/// sandbox at its `sandbox_ipv6` (ipv6_pool ‖ sandbox address) as at its
/// IPv4 sandbox address — TCP, UDP, ping; the container sees the gateway's
/// fd63:7562:6500::5 — and only root (or a host_access uid) opens flows;
/// the container reaches the node's services at fd63:7562:6500::5, the
/// node seeing its `sandbox_ipv6`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_reaches_sandboxes_over_ipv6_as_over_ipv4() {
    require_root!();
    let (env, _world) = node6(&[], None);
    let c = env.client().await;
    let a = Ctr::new("v6h2a");
    add(&env, "h6", &a, json!({}));
    let b = Ctr::new("v6h2b");
    add(&env, "h6b", &b, json!({}));
    ready6(&a, false, Duration::from_secs(10)).expect("no IPv6 address");
    let net = c.get("cni:h6:eth0").await.unwrap();
    let sb4: std::net::Ipv4Addr = common::s(&net, "sandbox_ip").parse().unwrap();
    let sb6: Ipv6Addr = common::s(&net, "sandbox_ipv6").parse().unwrap();
    let o = sb4.octets();
    assert_eq!(
        sb6,
        Ipv6Addr::new(
            0xfd63,
            0x7562,
            0x6501,
            0,
            0,
            0,
            u16::from_be_bytes([o[0], o[1]]),
            u16::from_be_bytes([o[2], o[3]])
        )
    );
    let sb6b: Ipv6Addr = common::s(&c.get("cni:h6b:eth0").await.unwrap(), "sandbox_ipv6")
        .parse()
        .unwrap();
    assert_ne!(sb6, sb6b);
    let gw6: IpAddr = "fd63:7562:6500::5".parse().unwrap();
    let any6 = |p: u16| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), p);

    // The node opens flows to the sandbox: TCP, UDP, ping.
    let tcp = Server::tcp(&a.name, any6(7000), b"ctr:");
    let udp = Server::udp(&a.name, any6(7001), b"ctr:");
    let tcp_b = Server::tcp(&b.name, any6(7000), b"b:");
    let got = tcp_exchange_in(&env.ns, SocketAddr::new(sb6.into(), 7000), b"tcp6", T);
    let (_, checks) = c.health().await;
    assert_eq!(
        got.as_deref(),
        Ok(&b"ctr:tcp6"[..]),
        "{}",
        datapath_detail(&checks)
    );
    let got = udp_exchange_in(&env.ns, SocketAddr::new(sb6.into(), 7001), b"udp6", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:udp6"[..]));
    for p in tcp.peers().iter().chain(&udp.peers()) {
        assert_eq!(p.ip(), gw6, "the container sees the gateway");
    }
    // Echo over ICMPv6 datagram sockets, open to every uid here (then
    // only the datapath can refuse one).
    sh_as(
        &env.ns,
        None,
        "sysctl -qw net.ipv4.ping_group_range='0 2147483647'",
    );
    let ping = format!(
        "/usr/bin/python3 -c \"import socket\n\
         s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6)\n\
         s.settimeout(2)\n\
         s.sendto(bytes([128,0,0,0,0,0,0,1])+b'ping', ('{sb6}', 0))\n\
         print(s.recv(64)[8:])\""
    );
    let (pinged, out) = sh_as(&env.ns, None, &ping);
    assert!(pinged && out.contains("ping"), "{out}");
    // Each sandbox at its own address.
    let got = tcp_exchange_in(&env.ns, SocketAddr::new(sb6b.into(), 7000), b"x", T);
    assert_eq!(got.as_deref(), Ok(&b"b:x"[..]));
    assert_eq!(tcp.peers().len(), 1);
    assert_eq!(tcp_b.peers().len(), 1);

    // A local user who is not root opens nothing: no TCP, no UDP answer,
    // no ping (IPv4's admission).
    let py = |proto: &str| {
        format!(
            "/usr/bin/python3 -c \"import socket\n\
             s=socket.socket(socket.AF_INET6, socket.SOCK_{proto})\n\
             s.settimeout(2)\n\
             s.connect(('{sb6}', {port}))\n\
             s.send(b'me')\n\
             {shut}print(s.recv(64))\"",
            port = if proto == "STREAM" { 7000 } else { 7001 },
            shut = if proto == "STREAM" {
                "s.shutdown(1)\n"
            } else {
                ""
            }
        )
    };
    for proto in ["STREAM", "DGRAM"] {
        let (ok, out) = sh_as(&env.ns, Some(65534), &py(proto));
        assert!(!ok, "uid 65534 reached the sandbox over {proto}: {out}");
    }
    let (pinged, out) = sh_as(&env.ns, Some(65534), &ping);
    assert!(
        !pinged && out.contains("timed out"),
        "uid 65534 pinged the sandbox: {out}"
    );
    assert_eq!(tcp.peers().len(), 1);
    assert_eq!(udp.peers().len(), 1);
    // Root still does (the denial was the uid's, not a broken path).
    let (ok, out) = sh_as(&env.ns, None, &py("STREAM"));
    assert!(ok && out.contains("ctr:me"), "{out}");

    // The container reaches the node at the gateway's address; the node
    // sees the sandbox's IPv6 identity.
    let host = Server::tcp(&env.ns, any6(7100), b"host:");
    let host_udp = Server::udp(&env.ns, any6(7101), b"host:");
    let got = tcp_exchange_in(&a.name, SocketAddr::new(gw6, 7100), b"up", T);
    assert_eq!(got.as_deref(), Ok(&b"host:up"[..]));
    let got = udp_exchange_in(&a.name, SocketAddr::new(gw6, 7101), b"up", T);
    assert_eq!(got.as_deref(), Ok(&b"host:up"[..]));
    for p in host.peers().iter().chain(&host_udp.peers()) {
        assert_eq!(
            p.ip(),
            IpAddr::V6(sb6),
            "the node sees the sandbox's identity"
        );
    }
    // The proxy's ports are not the guest's to reach this way: the agent's
    // proxy listens on the device's IPv6 address there (and would take the
    // connection, then reset it: a leak would connect), but only flows the
    // datapath steered get there.
    let (_, host6) = sh_as(
        &env.ns,
        None,
        "ss -Htln 'sport = :1021' | grep -o 'fd63:7562:6501::[0-9a-f:]*'",
    );
    let host6: Ipv6Addr = host6.trim().parse().expect("the proxy listens on IPv6");
    assert_eq!(host6, "fd63:7562:6501::c0a8:1".parse::<Ipv6Addr>().unwrap());
    let got = tcp_exchange_in(
        &a.name,
        SocketAddr::new(gw6, 1021),
        b"p",
        Duration::from_secs(2),
    );
    assert!(
        got.as_ref()
            .is_err_and(|e| e.starts_with("connect") && e.contains("timed out")),
        "{got:?}"
    );

    // Counted as host flows of the IPv6 family.
    let t = c.traffic("cni:h6:eth0").await;
    assert!(t["new_flows_host_ipv6"] >= 5, "{t:?}");
    assert_eq!(t["new_flows_host"], t["new_flows_host_ipv6"], "{t:?}");

    // The pool's route removed by someone else: Health says so, Reconcile
    // puts it back, and the host reaches the sandbox again.
    sh_as(&env.ns, None, "ip -6 route del fd63:7562:6501::/96");
    common::health_until(&c, "gateway false", |ok, checks| {
        !ok && checks
            .iter()
            .any(|k| k.0 == "gateway_device" && !k.1 && k.2.contains("ipv6_pool"))
    })
    .await;
    let r = c.reconcile("").await.unwrap();
    let repaired: Vec<String> = r["repaired"].try_clone().unwrap().try_into().unwrap();
    assert!(
        repaired.iter().any(|m| m.contains("ipv6_pool")),
        "{repaired:?}"
    );
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:?}");
    let got = tcp_exchange_in(&env.ns, SocketAddr::new(sb6.into(), 7000), b"again", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:again"[..]));
    // So does the neighbour the route goes via (without it the host's
    // packets wait for a neighbour solicitation nobody answers).
    sh_as(
        &env.ns,
        None,
        &format!("ip -6 neigh del {GATEWAY_LL} dev cube-dev"),
    );
    common::health_until(&c, "gateway false (neighbour)", |ok, checks| {
        !ok && checks.iter().any(|k| {
            k.0 == "gateway_device" && !k.1 && k.2.contains(&format!("neighbour {GATEWAY_LL}"))
        })
    })
    .await;
    let r = c.reconcile("").await.unwrap();
    let repaired: Vec<String> = r["repaired"].try_clone().unwrap().try_into().unwrap();
    assert!(
        repaired.iter().any(|m| m.contains("neighbour")),
        "{repaired:?}"
    );
    let got = tcp_exchange_in(&env.ns, SocketAddr::new(sb6.into(), 7000), b"more", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:more"[..]));
}

/// DNS and strict mode over IPv6 go through the agent as over IPv4
/// (docs/dual-stack.md "Policy parity"): the RA's resolver
/// (fd63:7562:6500::5) answers over UDP and TCP; DNS to any other IPv6
/// resolver is the agent's (a refused name stays refused; an answer comes
/// from the address the client asked); a strict-mode sandbox's HTTP and
/// TLS to an IPv6 address go to its proxy, which checks the name and dials
/// it itself (the world sees the node's IPv4 address, never a NAT66 flow)
/// or resets the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_and_strict_mode_over_ipv6_go_through_the_agent() {
    require_root!();
    let (env, world) = node6(&["--dns-upstream", "198.51.100.2"], Some(&[OTHER6]));
    let _dns = common::dnsmasq::start(
        &world,
        &[
            format!("--host-record=www.allowed.test,{WORLD_IP},{WORLD_IP6}"),
            format!("--host-record=denied.test,{WORLD_IP},{WORLD_IP6}"),
        ],
        "www.allowed.test",
    );
    // Dual-stack listeners: an IPv6 flow that left by NAT66 would be seen
    // from the node's IPv6 address.
    world.tcp_server6(80);
    world.tcp_server6(443);
    let c = env.client().await;
    let ctr = Ctr::new("v6sni");
    add(
        &env,
        "sni6",
        &ctr,
        json!({
            "allowOut": ["*.allowed.test"],
            "denyOut": ["0.0.0.0/0"],
            "egressMode": "sni",
        }),
    );
    let net = c.get("cni:sni6:eth0").await.unwrap();
    assert!(
        bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap(),
        "strict mode keeps IPv6"
    );
    ready6(&ctr, true, Duration::from_secs(10)).expect("no IPv6 address and route");
    let _conf = ctr.resolv_conf("169.254.68.5");
    let dig = |q: &str| ctr.sh(&format!("dig +time=2 +tries=1 {q} 2>&1"));

    // The RA's resolver, over UDP and TCP.
    for tcp in ["", "+tcp"] {
        let out = dig(&format!("{tcp} @fd63:7562:6500::5 AAAA www.allowed.test"));
        assert!(
            out.contains("status: NOERROR") && out.contains(&WORLD_IP6.to_string()),
            "{out}"
        );
        let out = dig(&format!("{tcp} @fd63:7562:6500::5 A denied.test"));
        assert!(out.contains("status: REFUSED"), "{out}");
    }
    // Another IPv6 resolver (the world's address: nothing listens there on
    // port 53; OTHER6: nothing at all): the agent answers, from the address
    // asked (dig checks the reply's source).
    for server in [WORLD_IP6, OTHER6] {
        for tcp in ["", "+tcp"] {
            let out = dig(&format!("{tcp} @{server} A denied.test"));
            assert!(out.contains("status: REFUSED"), "{server} {tcp}: {out}");
            let out = dig(&format!("{tcp} @{server} A www.allowed.test"));
            assert!(
                out.contains("status: NOERROR")
                    && out.contains(&WORLD_IP.to_string())
                    && out.contains(&format!("SERVER: {server}#53")),
                "{server} {tcp}: {out}"
            );
        }
    }

    // Strict mode: HTTP to the allowed name over IPv6, through the proxy.
    let curl = |args: &str| {
        ctr.sh(&format!(
            "curl -6 -sS --http0.9 --connect-timeout 2 --max-time 5 {args} 2>&1; echo \" rc=$?\""
        ))
    };
    let reset = |out: &str| out.contains("reset by peer") && !out.ends_with(" rc=0\n");
    let out = curl("http://www.allowed.test/");
    assert!(
        out.starts_with("world:GET /") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    // An allowed Host at an address where nothing listens: the proxy dials
    // the name.
    let out = curl(&format!(
        "--resolve www.allowed.test:80:[{OTHER6}] http://www.allowed.test/"
    ));
    assert!(out.starts_with("world:GET /"), "{out}");
    // A refused Host, and an address as the name: reset at once.
    let out = curl("-H 'Host: denied.test' http://www.allowed.test/");
    assert!(reset(&out), "{out}");
    let out = curl(&format!("http://[{WORLD_IP6}]/"));
    assert!(reset(&out), "{out}");
    // TLS: an unlisted SNI is reset; an allowed one is dialled (the world's
    // port 443 is no TLS server: what counts is who connects there).
    let s_client = |sni: &str| {
        ctr.sh(&format!(
            "echo | timeout 5 openssl s_client -connect [{WORLD_IP6}]:443 -servername {sni} 2>&1"
        ))
    };
    let out = s_client("denied.test");
    assert!(
        out.contains("errno=104") || out.contains("reset by peer"),
        "{out}"
    );
    assert!(world.peers(443).is_empty(), "{:?}", world.peers(443));
    s_client("www.allowed.test");
    // Everything the world saw came from the node's IPv4 address: the
    // proxy's connections, none of the guest's own.
    let peers: Vec<IpAddr> = [80, 443]
        .iter()
        .flat_map(|p| world.peers(*p))
        .map(|p| p.ip().to_canonical())
        .collect();
    assert_eq!(peers.len(), 3, "{peers:?}");
    assert!(
        peers
            .iter()
            .all(|p| *p == IpAddr::V4(common::world::NODE_IP)),
        "{peers:?}"
    );
    // Other ports follow DNS mode: the learned address, over NAT66.
    let port = world.tcp_server6(0);
    assert_eq!(
        tcp_exchange_in(
            &ctr.name,
            SocketAddr::new(WORLD_IP6.into(), port),
            b"dns",
            T
        )
        .as_deref(),
        Ok(&b"world:dns"[..])
    );
    assert_eq!(world.peers(port)[0].ip(), IpAddr::V6(NODE_IP6));
    // A segment to 443 of a flow the proxy never had (no SYN: a flow from
    // before the sandbox was put in strict mode, or one the reaper ended)
    // is answered at once with the RST a closed port sends, from the
    // address dialled, and never goes on. A raw socket sends the ACK and
    // reads what comes back.
    let stale0 = c.traffic("cni:sni6:eth0").await["drop_stale_tcp_ipv6"];
    let out = ctr.sh(&format!(
        "/usr/bin/python3 -c \"import socket, struct, time\n\
         s=socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_TCP)\n\
         s.setsockopt(socket.IPPROTO_IPV6, 7, 16)\n\
         s.settimeout(2)\n\
         s.sendto(struct.pack('!HHIIBBHHH', 40001, 443, 1000, 2000, 0x50, 0x10, 1024, 0, 0), ('{WORLD_IP6}', 0))\n\
         while True:\n\
         \x20   d, a = s.recvfrom(2048)\n\
         \x20   sp, dp, seq, ack, off, fl = struct.unpack('!HHIIBB', d[:14])\n\
         \x20   if (sp, dp) == (443, 40001):\n\
         \x20       print(a[0], 'rst' if fl & 4 else 'flags %x' % fl)\n\
         \x20       break\n\" 2>&1"
    ));
    assert_eq!(out, format!("{WORLD_IP6} rst\n"));
    assert_eq!(
        c.traffic("cni:sni6:eth0").await["drop_stale_tcp_ipv6"],
        stale0 + 1
    );
    let refused = c.traffic("cni:sni6:eth0").await["dns_refused"];
    assert!(refused >= 8, "refused {refused}");
    let (healthy, checks) = c.health().await;
    assert!(
        healthy,
        "{:?}",
        checks.iter().filter(|c| !c.1).collect::<Vec<_>>()
    );
}

/// A CNI port mapping (runtimeConfig.portMappings[]).
fn mapping(host: u16, container: u16, proto: &str, host_ip: &str) -> serde_json::Value {
    json!({"hostPort": host, "containerPort": container, "protocol": proto, "hostIP": host_ip})
}

/// CNI config with one port mapping on every node address.
fn one_mapping(host: u16, container: u16, proto: &str) -> serde_json::Value {
    json!({"runtimeConfig": {"portMappings": [mapping(host, container, proto, "")]}})
}

/// A guest configured statically (only fd63:7562:6500::6, no SLAAC
/// address) is reached there by what others open to it: the node's flows
/// to its sandbox_ipv6, the world's through a port mapping, and the
/// replies of its own flows to the node. The datapath learns the address
/// from its Duplicate Address Detection (before the guest sent anything
/// from it) and follows the guest back to SLAAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_on_its_fixed_address_is_reached_there() {
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let c = env.client().await;
    let ctr = Ctr::new("v6fixed");
    add(&env, "fx", &ctr, one_mapping(20190, 8090, "tcp"));
    let (_, slaac) = ready6(&ctr, true, Duration::from_secs(10)).expect("no IPv6 address");
    let sb6: Ipv6Addr = common::s(&c.get("cni:fx:eth0").await.unwrap(), "sandbox_ipv6")
        .parse()
        .unwrap();
    let any6 = |p: u16| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), p);
    let _srv = Server::tcp(&ctr.name, any6(7000), b"ctr:");
    let mapped = Server::tcp(&ctr.name, any6(8090), b"mapped:");
    let node_srv = Server::tcp(&env.ns, any6(7100), b"node:");
    let to_sb = SocketAddr::new(sb6.into(), 7000);
    let to_mapping = SocketAddr::new(NODE_IP6.into(), 20190);
    let got = tcp_exchange_in(&env.ns, to_sb, b"slaac", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:slaac"[..]));

    // Static: only ::6, claimed with Duplicate Address Detection, and the
    // node connects first.
    let fixed: Ipv6Addr = "fd63:7562:6500::6".parse().unwrap();
    let to_static = |a: Ipv6Addr| {
        format!(
            "sysctl -qw net.ipv6.conf.eth0.autoconf=0 net.ipv6.conf.eth0.accept_dad=1 && \
             ip -6 addr flush dev eth0 scope global && ip -6 addr add {a}/64 dev eth0"
        )
    };
    ctr.sh(&to_static(fixed));
    let (_, now) = ready6(&ctr, true, Duration::from_secs(10)).expect("no usable ::6");
    assert_eq!(now, fixed);
    let (_, checks) = c.health().await;
    let got = tcp_exchange_in(&env.ns, to_sb, b"node", T);
    assert_eq!(
        got.as_deref(),
        Ok(&b"ctr:node"[..]),
        "{}",
        datapath_detail(&checks)
    );
    let got = tcp_exchange_in(&world.ns, to_mapping, b"world", T);
    assert_eq!(got.as_deref(), Ok(&b"mapped:world"[..]));
    assert_eq!(mapped.peers()[0].ip(), IpAddr::V6(WORLD_IP6));
    // The node's ping.
    let ping = format!(
        "/usr/bin/python3 -c \"import socket\n\
         s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6)\n\
         s.settimeout(2)\n\
         s.sendto(bytes([128,0,0,0,0,0,0,1])+b'ping', ('{sb6}', 0))\n\
         print(s.recv(64)[8:])\""
    );
    sh_as(
        &env.ns,
        None,
        "sysctl -qw net.ipv4.ping_group_range='0 2147483647'",
    );
    let (pinged, out) = sh_as(&env.ns, None, &ping);
    assert!(pinged && out.contains("ping"), "{out}");
    // The guest's own flow to the node: its replies reach ::6.
    let out = ctr.sh("/usr/bin/python3 -c \"import socket\n\
         s=socket.create_connection(('fd63:7562:6500::5', 7100), timeout=3)\n\
         print(s.getsockname()[0])\n\
         s.sendall(b'guest')\n\
         s.shutdown(1)\n\
         print(s.recv(64).decode())\"");
    assert_eq!(out, format!("{fixed}\nnode:guest\n"));
    assert_eq!(node_srv.peers()[0].ip(), IpAddr::V6(sb6));

    // Back to SLAAC: followed.
    ctr.sh(&to_static(slaac));
    let (_, now) = ready6(&ctr, true, Duration::from_secs(10)).expect("no usable SLAAC address");
    assert_eq!(now, slaac);
    let got = tcp_exchange_in(&env.ns, to_sb, b"back", T);
    assert_eq!(got.as_deref(), Ok(&b"ctr:back"[..]));
    let got = tcp_exchange_in(&world.ns, to_mapping, b"again", T);
    assert_eq!(got.as_deref(), Ok(&b"mapped:again"[..]));

    // Both addresses: a mapped connection to the SLAAC one keeps it when
    // the guest's current address becomes ::6 (a datagram from there).
    drop(mapped);
    let mut echo = std::process::Command::new("ip")
        .args(["netns", "exec", &ctr.name, "/usr/bin/python3", "-c"])
        .arg(
            "import socket\n\
             l=socket.socket(socket.AF_INET6)\n\
             l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             l.bind(('::', 8090)); l.listen(4); l.settimeout(30)\n\
             print('ready', flush=True)\n\
             c, _ = l.accept(); c.settimeout(30)\n\
             while True:\n\
             \x20   d = c.recv(64)\n\
             \x20   if not d: break\n\
             \x20   c.sendall(c.getsockname()[0].encode() + b' ' + d)\n",
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null()) // a failed test must not wait for it
        .spawn()
        .unwrap();
    echo.stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut [0u8; 6])
        .unwrap();
    let mut live = in_netns(&world.ns, move || {
        TcpStream::connect_timeout(&to_mapping, T)
    })
    .unwrap();
    live.set_read_timeout(Some(T)).unwrap();
    let mut say = |m: &str| -> String {
        live.write_all(m.as_bytes()).unwrap();
        let mut b = [0u8; 128];
        let n = live.read(&mut b).unwrap_or(0);
        String::from_utf8_lossy(&b[..n]).into_owned()
    };
    assert_eq!(say("one"), format!("{slaac} one"));
    let out = ctr.sh(&format!(
        "ip -6 addr add {fixed}/64 dev eth0 nodad && /usr/bin/python3 -c \"import socket\n\
         s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         s.bind(('{fixed}', 0))\n\
         s.sendto(b'x', ('fd63:7562:6500::5', 9))\n\
         print('sent')\" 2>&1"
    ));
    assert_eq!(out, "sent\n");
    assert_eq!(say("two"), format!("{slaac} two"));
    let _ = echo.kill();
    let _ = echo.wait();
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
}

/// Datagrams from the world fragmented on the way (IPv6 has no router
/// fragmentation, but its senders fragment what exceeds the path's MTU)
/// reach the guest whole, as IPv4's: a NAT66 flow's large reply and a
/// large datagram to a mapped UDP port. The first fragment is translated
/// as a whole datagram, the later ones follow it (`frags6`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragmented_datagrams_from_the_world_reach_the_guest() {
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let c = env.client().await;
    let ctr = Ctr::new("v6frag");
    let mut conf = one_mapping(20195, 8095, "udp");
    // The uplink's MTU: the world's fragments (1448 bytes and more) fit the
    // container's link (a packet larger than the sandbox's MTU is dropped:
    // docs/dual-stack.md).
    conf["mtu"] = json!(1500);
    add(&env, "fr", &ctr, conf);
    if ready6(&ctr, true, Duration::from_secs(10)).is_none() {
        panic!("no IPv6 address and route: {:?}", c.health().await);
    }
    let (_, checks) = c.health().await;
    let frags0 = counter(&checks, "frag");

    // A NAT66 flow's reply of 3000 bytes and more (three fragments on the
    // world's 1500-byte link).
    let big = vec![b'y'; 3000];
    let srv = Server::udp(&world.ns, SocketAddr::new(WORLD_IP6.into(), 9095), &big);
    let got = udp_exchange_in(&ctr.name, srv.addr, b"hi", T);
    let (_, checks) = c.health().await;
    let got = got.unwrap_or_else(|e| panic!("{e}: {}", datapath_detail(&checks)));
    assert_eq!(got.len(), 3002);
    assert!(got.ends_with(b"hi") && got[..3000].iter().all(|b| *b == b'y'));
    let frags1 = counter(&checks, "frag");
    assert!(frags1 >= frags0 + 2, "{frags0} -> {frags1}");

    // 5000 bytes to a mapped UDP port; the container answers with the
    // size it received (small: a guest's own fragments are dropped, as
    // IPv4's).
    let mut sizer = std::process::Command::new("ip")
        .args(["netns", "exec", &ctr.name, "/usr/bin/python3", "-c"])
        .arg(
            "import socket\n\
             s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
             s.bind(('::', 8095)); s.settimeout(30)\n\
             print('ready', flush=True)\n\
             while True:\n\
             \x20   d, a = s.recvfrom(65536)\n\
             \x20   s.sendto(str(len(d)).encode(), a)\n",
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null()) // a failed test must not wait for it
        .spawn()
        .unwrap();
    let mut ready = [0u8; 6];
    sizer
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    let got = udp_exchange_in(
        &world.ns,
        SocketAddr::new(NODE_IP6.into(), 20195),
        &[b'z'; 5000],
        T,
    );
    let _ = sizer.kill();
    let _ = sizer.wait();
    assert_eq!(got.as_deref(), Ok(&b"5000"[..]));
    let (healthy, checks) = c.health().await;
    assert!(counter(&checks, "frag") >= frags1 + 3, "{checks:?}");
    assert!(healthy, "{checks:?}");
}

/// A mapping with an IPv6 `host_ip` ("::", or the uplink's IPv6 address)
/// is on the node's IPv6 address only: reached over IPv6, never over IPv4
/// (neither from the world nor through lo). One on another address, on
/// loopback or link-local is refused with the reason, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_host_addresses_map_ipv6_only() {
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let c = env.client().await;
    let ctr = Ctr::new("v6only");
    let pm = |h: u16, ctr: u16, ip: String| mapping(h, ctr, "tcp", &ip);
    let r = add(
        &env,
        "v6o",
        &ctr,
        json!({"runtimeConfig": {"portMappings": [
            pm(20186, 8086, "::".into()), pm(20187, 8087, NODE_IP6.to_string()),
            pm(20188, 8088, "0:0::0".into())]}}),
    );
    ready6(&ctr, true, Duration::from_secs(10)).expect("no IPv6 address and route");
    let any6 = |p: u16| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), p);
    let _a = Server::tcp(&ctr.name, any6(8086), b"any6:");
    let _b = Server::tcp(&ctr.name, any6(8087), b"node6:");
    let _d = Server::tcp(&ctr.name, any6(8088), b"zero:");
    for (port, want) in [(20186, "any6:x"), (20187, "node6:x"), (20188, "zero:x")] {
        let got = tcp_exchange_in(&world.ns, SocketAddr::new(NODE_IP6.into(), port), b"x", T);
        assert_eq!(got.as_deref(), Ok(want.as_bytes()), "{port}");
        for to in [
            SocketAddr::new(common::world::NODE_IP.into(), port),
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), port),
        ] {
            let ns = if to.ip().is_loopback() {
                &env.ns
            } else {
                &world.ns
            };
            let got = tcp_exchange_in(ns, to, b"x", T);
            assert!(
                got.as_ref().is_err_and(|e| e.contains("refused")),
                "{to}: {got:?}"
            );
        }
    }
    // The spelling the record keeps.
    let hosts: Vec<String> = common::mappings(&c.get("cni:v6o:eth0").await.unwrap())
        .into_iter()
        .map(|m| m.3)
        .collect();
    assert_eq!(
        hosts,
        ["::".to_string(), NODE_IP6.to_string(), "::".into()],
        "{r}"
    );

    // Refused, naming why; nothing made.
    for (ip, why) in [
        (
            "2001:db8:c0be::99".to_string(),
            format!("the uplink's, {NODE_IP6}"),
        ),
        ("::1".into(), "use 127.0.0.1".into()),
        ("fe80::1".into(), "not a unicast address".into()),
    ] {
        let e = c
            .ensure(
                "bad6",
                common::opts(vec![(
                    "port_mappings",
                    common::ports(&[("tcp", 80, 0, &ip)]),
                )]),
            )
            .await
            .unwrap_err();
        assert!(e.name.ends_with("InvalidArgument"), "{ip}: {e:?}");
        assert!(
            e.message.contains(&format!("host_ip {ip}")) && e.message.contains(&why),
            "{ip}: {e:?}"
        );
        assert!(c.get("bad6").await.is_err(), "{ip}: a network was made");
    }
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
}

/// TrafficWhilePaused names an IPv6 sender by its IPv6 address (issue 44,
/// item 6; before: 0.0.0.0 for the world's, 192.168.0.1 for the node's):
/// the world through a mapping on the node's IPv6 address, then, in the
/// next pause, the node to the sandbox's IPv6 identity (from the gateway
/// device's IPv6 address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_reports_ipv6_senders_by_their_address() {
    use futures::StreamExt;
    require_root!();
    let (env, world) = node6(&[], Some(&[]));
    let c = env.client().await;
    let mut signals = c.signals("TrafficWhilePaused").await;
    let net = c
        .ensure(
            "p6",
            common::opts(vec![(
                "port_mappings",
                common::ports(&[("tcp", 80, 0, "")]),
            )]),
        )
        .await
        .unwrap();
    let hp = common::mappings(&net)[0].2;
    let sandbox6: Ipv6Addr = common::s(&net, "sandbox_ipv6").parse().unwrap();
    let _g = common::guest::Guest::start_default(c.open_tap("p6").await.unwrap());
    let pause = |paused: bool| {
        common::opts(vec![
            ("port_mappings", common::ports(&[("tcp", 80, hp, "")])),
            ("paused", zbus::zvariant::Value::from(paused)),
        ])
    };
    let mut next_remote = async |what: &str| {
        let msg = tokio::time::timeout(T, signals.next())
            .await
            .unwrap_or_else(|_| panic!("no TrafficWhilePaused for {what}"))
            .unwrap()
            .unwrap();
        let (_, details): (String, common::Dict) = msg.body().deserialize().unwrap();
        (common::s(&details, "remote_ip"), common::s(&details, "via"))
    };
    c.ensure("p6", pause(true)).await.unwrap();
    let ns = world.ns.clone();
    let short = Duration::from_millis(700);
    let attempt = std::thread::spawn(move || {
        tcp_exchange_in(&ns, SocketAddr::new(IpAddr::V6(NODE_IP6), hp), b"", short)
    });
    assert_eq!(
        next_remote("the world over IPv6").await,
        (WORLD_IP6.to_string(), "port_mapping".to_owned())
    );
    assert!(attempt.join().unwrap().is_err(), "connected while paused");
    c.ensure("p6", pause(false)).await.unwrap();
    c.ensure("p6", pause(true)).await.unwrap();
    let ns = env.ns.clone();
    let attempt = std::thread::spawn(move || {
        tcp_exchange_in(&ns, SocketAddr::new(IpAddr::V6(sandbox6), 80), b"", short)
    });
    let mut device6 = sandbox6.octets();
    device6[12..].copy_from_slice(&[192, 168, 0, 1]);
    assert_eq!(
        next_remote("the node over IPv6").await,
        (Ipv6Addr::from(device6).to_string(), "host".to_owned())
    );
    assert!(attempt.join().unwrap().is_err(), "connected while paused");
}
