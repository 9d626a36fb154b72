//! The flow log (docs/flows.md) with real packets: a smoltcp guest on the
//! far side of the agent's TAP, a "world" namespace behind the uplink.
//! Every flow it makes, and every one refused, is one record in varlink
//! `WatchFlows` and `cubenetctl flows`, with the right fields; a flow's
//! end carries its IP bytes and packets. Root only.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use common::guest::GUEST_IP;
use common::world::{self, World, guest_for, node};
use common::{Env, mappings, opts, ports};
use serde_json::{Value as Json, json};
use zbus::zvariant::Value;

const T: Duration = Duration::from_secs(5);
const CTL: &str = env!("CARGO_BIN_EXE_cubenetctl");

fn watch_flows(env: &Env, params: Json) -> Vec<Json> {
    common::flows::watch(env, params)
}

/// The records of sandbox `id` (no loss reports), waiting up to 10 s
/// until `done` holds for them.
fn flows_until(env: &Env, id: &str, done: impl Fn(&[Json]) -> bool) -> Vec<Json> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let replies = watch_flows(env, json!({"sandbox_id": id}));
        assert!(
            replies.iter().all(|r| r.get("lost").is_none()),
            "nothing may be lost here: {replies:?}"
        );
        let flows: Vec<Json> = replies
            .into_iter()
            .filter_map(|r| r.get("flow").cloned())
            .collect();
        if done(&flows) || Instant::now() > until {
            return flows;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn find<'a>(flows: &'a [Json], event: &str, proto: &str, remote_port: u16) -> Vec<&'a Json> {
    flows
        .iter()
        .filter(|f| {
            f["event"] == event && f["protocol"] == proto && f["remote"]["port"] == remote_port
        })
        .collect()
}

fn n(v: &Json) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// TCP, UDP and ICMP out, a denied CIDR, a port-mapped connection from the
/// world: each is one start (or refused) record with the guest's and the
/// node's view, and TCP's end carries its bytes and packets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_flow_and_refusal_of_a_tap_guest_is_one_record() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let tcp = world.tcp_server(9191);
    let udp = world.udp_echo(9192);
    let (net, g) = guest_for(
        &c,
        "fl",
        opts(vec![
            ("deny_out", Value::from(vec!["203.0.113.0/24".to_string()])),
            ("port_mappings", ports(&[("tcp", 80, 0, "")])),
        ]),
    )
    .await;
    let host_port = mappings(&net)[0].2;
    g.tcp_listen(80).unwrap();

    // Allowed: TCP with a payload of 3000 bytes, UDP, a ping.
    let payload = vec![b'p'; 3000];
    let got = g.tcp_connect_send_recv(tcp, &payload, T).unwrap();
    assert_eq!(got.len(), payload.len() + 6);
    assert_eq!(g.udp_send_recv(udp, b"u", T).unwrap(), b"world:u");
    g.ping(Ipv4Addr::new(198, 51, 100, 2), T).unwrap();
    // Denied by a CIDR: refused.
    let denied = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 7), 4444);
    assert!(
        g.tcp_connect_send_recv(denied, b"x", Duration::from_millis(800))
            .is_err()
    );
    // From the world to the mapping.
    let ns = format!("{}-w", env.ns);
    let got = world::tcp_exchange_in(&ns, World::node_addr(host_port), b"in", T).unwrap();
    assert_eq!(got, b"guest:80");
    // From the node to the sandbox's address.
    let sandbox_ip: Ipv4Addr = common::s(&net, "sandbox_ip").parse().unwrap();
    let got =
        world::tcp_exchange_in(&env.ns, SocketAddrV4::new(sandbox_ip, 80), b"host", T).unwrap();
    assert_eq!(got, b"guest:80");

    let host_end = |f: &[Json]| {
        f.iter()
            .any(|r| r["direction"] == "host" && r["event"] == "end" && r["guest"]["port"] == 80)
    };
    let flows = flows_until(&env, "fl", |f| {
        !find(f, "end", "tcp", tcp.port()).is_empty()
            && !find(f, "refused", "tcp", 4444).is_empty()
            && host_end(f)
    });
    let show = || serde_json::to_string_pretty(&flows).unwrap();

    // The TCP flow out: one start, the guest's and the node's view.
    let starts = find(&flows, "start", "tcp", tcp.port());
    assert_eq!(starts.len(), 1, "{}", show());
    let s = starts[0];
    assert_eq!(s["sandbox_id"], "fl");
    assert_eq!(s["direction"], "egress");
    assert_eq!(s["verdict"], "forwarded");
    assert_eq!(s["family"], 4);
    assert_eq!(s["guest"]["ip"], GUEST_IP.to_string());
    assert_eq!(s["remote"]["ip"], tcp.ip().to_string());
    assert_eq!(s["node"]["ip"], World::node_addr(0).ip().to_string());
    let snat_port = n(&s["node"]["port"]);
    assert!(snat_port > 0, "{}", show());
    // Its end: the flow's IP bytes and packets each way.
    let ends = find(&flows, "end", "tcp", tcp.port());
    assert_eq!(ends.len(), 1, "{}", show());
    let t = &ends[0]["totals"];
    let (bo, po, bi, pi) = (
        n(&t["bytes_out"]),
        n(&t["packets_out"]),
        n(&t["bytes_in"]),
        n(&t["packets_in"]),
    );
    eprintln!("tcp end: out {bo} B / {po} packets, in {bi} B / {pi} packets");
    // IPv4 + TCP headers with options are at most 20 + 60 bytes a packet.
    assert!(
        bo >= payload.len() as u64 && bo <= payload.len() as u64 + 80 * po,
        "{}",
        show()
    );
    let reply = payload.len() as u64 + 6;
    assert!(bi >= reply && bi <= reply + 80 * pi, "{}", show());
    assert!(
        po >= 3 && pi >= 3,
        "a handshake, data and a close: {}",
        show()
    );
    assert_eq!(n(&ends[0]["node"]["port"]), snat_port);

    // UDP and ICMP: one start each.
    assert_eq!(
        find(&flows, "start", "udp", udp.port()).len(),
        1,
        "{}",
        show()
    );
    let icmp: Vec<&Json> = flows
        .iter()
        .filter(|f| f["event"] == "start" && f["protocol"] == "icmp")
        .collect();
    assert_eq!(icmp.len(), 1, "{}", show());
    assert_eq!(icmp[0]["remote"]["ip"], "198.51.100.2");

    // The refusal: dropped by the policy, not forwarded.
    let refused = find(&flows, "refused", "tcp", 4444);
    assert!(!refused.is_empty(), "{}", show());
    assert_eq!(refused[0]["verdict"], "dropped");
    assert_eq!(refused[0]["reason"], "policy");
    assert_eq!(refused[0]["remote"]["ip"], "203.0.113.7");
    assert!(find(&flows, "start", "tcp", 4444).is_empty(), "{}", show());

    // The world's connection to the mapping: ingress, the node's port.
    let ins: Vec<&Json> = flows
        .iter()
        .filter(|f| f["event"] == "start" && f["direction"] == "ingress")
        .collect();
    assert_eq!(ins.len(), 1, "{}", show());
    assert_eq!(n(&ins[0]["node"]["port"]), u64::from(host_port));
    assert_eq!(n(&ins[0]["guest"]["port"]), 80);
    assert_eq!(ins[0]["remote"]["ip"], "198.51.100.2");

    // The node's connection to the sandbox address: a host flow, start and
    // end, the node's end of it named.
    let host: Vec<&Json> = flows
        .iter()
        .filter(|f| f["direction"] == "host" && f["guest"]["port"] == 80)
        .collect();
    assert_eq!(
        host.iter().filter(|f| f["event"] == "start").count(),
        1,
        "{}",
        show()
    );
    assert_eq!(
        host.iter().filter(|f| f["event"] == "end").count(),
        1,
        "{}",
        show()
    );
    assert_eq!(
        host[0]["remote"]["ip"], "169.254.68.5",
        "the guest sees its gateway"
    );
    assert!(host[0]["node"]["port"].as_u64().unwrap() > 0);

    // --denied: the refusal only.
    let denied_only: Vec<Json> = watch_flows(&env, json!({"sandbox_id": "fl", "denied": true}))
        .into_iter()
        .filter_map(|r| r.get("flow").cloned())
        .collect();
    assert!(!denied_only.is_empty());
    assert!(
        denied_only.iter().all(|f| f["verdict"] == "dropped"),
        "{denied_only:?}"
    );

    // cubenetctl flows shows the same records.
    let sock = env.dir.join("run/org.cube.NetworkAgent");
    let out = std::process::Command::new(CTL)
        .args(["--varlink", sock.to_str().unwrap(), "flows", "fl", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let lines: Vec<Json> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.iter().filter(|f| f["event"] == "refused").count(),
        denied_only.len()
    );
    assert_eq!(find(&lines, "end", "tcp", tcp.port()).len(), 1);
    let text = std::process::Command::new(CTL)
        .args([
            "--varlink",
            sock.to_str().unwrap(),
            "flows",
            "fl",
            "--denied",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    eprintln!("{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("203.0.113.7:4444") && l.contains("policy")),
        "{text}"
    );
}

/// A node facing a world with IPv6 too (`more`: the world's other
/// addresses), the agent started with `args`.
fn node6(args: &[&str], more: &[std::net::Ipv6Addr]) -> (Env, World) {
    let mut env = Env::new(args);
    let world = World::attach(&env);
    world.add_ipv6(more);
    env.kill_agent();
    env.start_agent();
    (env, world)
}

/// A world address outside WORLD_IP6's /64 (refused by the rules below).
const DENIED6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0x2001, 0xdb8, 0x5eed, 0, 0, 0, 0, 7);

/// deny_action "reject": a refused SYN gets the RST a closed port sends,
/// anything else ICMP/ICMPv6 administratively prohibited from the
/// gateway, both families, within the sandbox's rate; a forged source
/// gets nothing; a smoltcp guest's connect fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_action_reject_answers_refusals_at_once_both_families() {
    use common::guest::{
        GATEWAY_IP, GATEWAY_LL, GATEWAY_MAC, GUEST_IP6, GUEST_MAC, RawGuest, ip6_frame, parse_ip6,
        parse_ipv4, parse_tcp, tcp_frame, tcp6_segment, udp_frame, udp6_datagram,
    };
    require_root!();
    let (env, _world) = node6(&["--deny-action", "reject"], &[DENIED6]);
    let c = env.client().await;
    let rules = || {
        opts(vec![(
            "deny_out",
            Value::from(vec![
                "203.0.113.0/24".to_string(),
                "2001:db8:5eed::/48".to_string(),
            ]),
        )])
    };
    c.ensure("rj", rules()).await.unwrap();
    let raw = RawGuest::new(c.open_tap("rj").await.unwrap());
    let me = SocketAddrV4::new(GUEST_IP, 40001);
    let denied = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 7), 4444);

    // IPv4 TCP SYN: RST|ACK acknowledging it, from the address dialled.
    raw.send(&tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        me,
        denied,
        1000,
        0,
        0x02,
        b"",
    ))
    .unwrap();
    let rst = raw
        .recv_match(T, |f| parse_tcp(f).is_some_and(|s| s.dst == me))
        .expect("an RST for the refused SYN");
    let rst = parse_tcp(&rst).unwrap();
    assert_eq!(rst.src, denied);
    assert_eq!(rst.flags & 0x14, 0x14, "RST|ACK: {:#x}", rst.flags);
    assert_eq!(rst.ack, 1001);
    assert!(rst.checksums_ok);

    // IPv4 UDP: ICMP 3/13 from the gateway, quoting the datagram.
    let dgram = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 7), 5555);
    raw.send(&udp_frame(GUEST_MAC, GATEWAY_MAC, me, dgram, b"hello"))
        .unwrap();
    let icmp = raw
        .recv_match(T, |f| {
            parse_ipv4(f).is_some_and(|(_, d, p, _)| d == GUEST_IP && p == 1)
        })
        .expect("an ICMP error for the refused datagram");
    let (src, _, _, l4) = parse_ipv4(&icmp).unwrap();
    assert_eq!(src, GATEWAY_IP);
    assert_eq!((l4[0], l4[1]), (3, 13), "administratively prohibited");
    // The quoted header: our UDP datagram to 203.0.113.7:5555.
    assert_eq!(&l4[8 + 16..8 + 20], &[203, 0, 113, 7]);
    assert_eq!(u16::from_be_bytes([l4[8 + 22], l4[8 + 23]]), 5555);

    // IPv6 TCP SYN: an RST; UDP: ICMPv6 1/1 from the gateway.
    let syn6 = tcp6_segment(40002, 4444, 7000, 0, 0x02, b"");
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        DENIED6,
        6,
        64,
        &syn6,
    ))
    .unwrap();
    let rst6 = raw
        .recv_match(T, |f| {
            parse_ip6(f).is_some_and(|p| p.next == 6 && p.dst == GUEST_IP6)
        })
        .expect("an RST for the refused IPv6 SYN");
    let p = parse_ip6(&rst6).unwrap();
    assert_eq!(p.src, DENIED6);
    assert_eq!(p.l4[13] & 0x04, 0x04, "RST");
    assert!(p.checksum_ok);
    let u6 = udp6_datagram(40003, 5555, b"hi");
    raw.send(&ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP6,
        DENIED6,
        17,
        64,
        &u6,
    ))
    .unwrap();
    let e6 = raw
        .recv_match(T, |f| {
            parse_ip6(f).is_some_and(|p| p.next == 58 && p.l4[0] == 1)
        })
        .expect("an ICMPv6 error for the refused IPv6 datagram");
    let p = parse_ip6(&e6).unwrap();
    assert_eq!(p.src, GATEWAY_LL);
    assert_eq!(p.l4[1], 1, "administratively prohibited");
    assert!(p.checksum_ok);

    // A forged source is refused (spoofed) and never answered.
    let forged = SocketAddrV4::new(Ipv4Addr::new(10, 9, 9, 9), 40004);
    raw.send(&tcp_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        forged,
        denied,
        1,
        0,
        0x02,
        b"",
    ))
    .unwrap();
    assert!(
        raw.recv_match(Duration::from_millis(700), |f| parse_ipv4(f)
            .is_some_and(|(_, d, _, _)| d == *forged.ip()))
            .is_none(),
        "a forged source got an answer"
    );

    // The answers' rate: 2,000 refused datagrams at once get at most the
    // burst and the rate's share of answers.
    let started = Instant::now();
    for i in 0..2000u16 {
        let from = SocketAddrV4::new(GUEST_IP, 41000 + i);
        raw.send(&udp_frame(GUEST_MAC, GATEWAY_MAC, from, dgram, b"x"))
            .unwrap();
    }
    let mut answers = 0u64;
    while raw
        .recv_match(Duration::from_millis(500), |f| {
            parse_ipv4(f).is_some_and(|(_, d, p, _)| d == GUEST_IP && p == 1)
        })
        .is_some()
    {
        answers += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!("2000 refused datagrams in a burst: {answers} answers in {secs:.2} s");
    assert!(answers >= 1);
    assert!(
        (answers as f64) <= 400.0 + 200.0 * secs + 10.0,
        "{answers} answers in {secs:.2} s: the rate is 200/s, burst 400"
    );

    // The flow log names each refusal; the forged one as spoofed.
    let flows = flows_until(&env, "rj", |f| f.iter().any(|r| r["reason"] == "spoofed"));
    assert!(
        flows
            .iter()
            .any(|r| r["reason"] == "spoofed" && r["guest"]["ip"] == "10.9.9.9"),
        "{flows:?}"
    );
    assert!(
        flows
            .iter()
            .any(|r| r["reason"] == "policy" && r["family"] == 6)
    );

    // A guest's connect fails at once (printed, not asserted: timing).
    c.ensure("rj2", rules()).await.unwrap();
    let g = common::guest::Guest::start_default(c.open_tap("rj2").await.unwrap());
    let t0 = Instant::now();
    let r = g.tcp_connect_send_recv(denied, b"x", T);
    eprintln!(
        "smoltcp connect to a denied address with deny_action=reject: {:?} after {:?}",
        r.as_ref().err(),
        t0.elapsed()
    );
    assert!(r.is_err());
}

/// One sandbox floods refused packets as fast as one core sends them
/// while another opens 100 connections: every one of the victim's records
/// arrives; the flooder's are bounded by its share and its losses counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_sandbox_never_costs_another_its_records() {
    use common::guest::{GATEWAY_MAC, GUEST_MAC, RawGuest, udp_frame};
    require_root!();
    let textfile = std::env::temp_dir().join(format!("cna-flows-{}.prom", std::process::id()));
    let _ = std::fs::remove_file(&textfile);
    let tf = textfile.to_str().unwrap().to_owned();
    let (env, world) = node(&["--metrics-textfile", &tf, "--metrics-interval", "1"]);
    let c = env.client().await;
    let tcp = world.tcp_server(9393);
    c.ensure(
        "flood",
        opts(vec![(
            "deny_out",
            Value::from(vec!["203.0.113.0/24".to_string()]),
        )]),
    )
    .await
    .unwrap();
    let raw = RawGuest::new(c.open_tap("flood").await.unwrap());
    let (_, victim) = guest_for(&c, "victim", opts(vec![])).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let dst = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 9), 9);
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let from = SocketAddrV4::new(GUEST_IP, 1024 + (sent % 60000) as u16);
                if raw
                    .send(&udp_frame(GUEST_MAC, GATEWAY_MAC, from, dst, b"f"))
                    .is_ok()
                {
                    sent += 1;
                }
            }
            sent
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    for i in 0..100 {
        let msg = format!("v{i}");
        let got = victim
            .tcp_connect_send_recv(tcp, msg.as_bytes(), T)
            .unwrap();
        assert_eq!(got, format!("world:{msg}").as_bytes());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = flooder.join().unwrap();
    let secs = started.elapsed().as_secs_f64() + 0.3;
    eprintln!("flooder sent {sent} refused datagrams in {secs:.1} s");

    let flows = flows_until(&env, "victim", |f| {
        find(f, "start", "tcp", tcp.port()).len() >= 100
            && find(f, "end", "tcp", tcp.port()).len() >= 100
    });
    let starts = find(&flows, "start", "tcp", tcp.port());
    let mut by_port: std::collections::BTreeMap<u64, Vec<&Json>> = Default::default();
    for s in &starts {
        by_port.entry(n(&s["guest"]["port"])).or_default().push(s);
    }
    let twice: Vec<_> = by_port.values().filter(|v| v.len() > 1).collect();
    // Every connection's start arrives (a SYN the guest sent again on a
    // tuple already closed, under load, is a connection of its own).
    eprintln!(
        "the victim's starts: {} (ports twice: {twice:?})",
        starts.len()
    );
    assert!(starts.len() >= 100, "every start: {}", starts.len());
    assert!(
        find(&flows, "end", "tcp", tcp.port()).len() >= 100,
        "every end"
    );

    let flood: Vec<Json> = watch_flows(&env, json!({"sandbox_id": "flood"}))
        .into_iter()
        .filter_map(|r| r.get("flow").cloned())
        .collect();
    eprintln!("the flooder's records: {}", flood.len());
    assert!(!flood.is_empty());
    assert!(
        (flood.len() as f64) <= 400.0 + 200.0 * (secs + 1.0) + 10.0,
        "{} records in {secs:.1} s: the share is 200/s, burst 400",
        flood.len()
    );
    // Its losses are counted (metrics).
    let until = Instant::now() + Duration::from_secs(10);
    let lost = loop {
        let text = std::fs::read_to_string(&textfile).unwrap_or_default();
        let lost: u64 = text
            .lines()
            .find(|l| {
                l.starts_with("cube_network_agent_sandbox_flow_events_lost_total")
                    && l.contains("sandbox_id=\"flood\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0);
        if lost > 0 || Instant::now() > until {
            break lost;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    eprintln!("the flooder's lost events: {lost}");
    assert!(
        lost > 0 && lost + flood.len() as u64 <= sent,
        "lost {lost}, sent {sent}"
    );
    let _ = std::fs::remove_file(&textfile);
}

/// A WatchFlows client that stops reading: the agent's other calls and
/// the datapath go on; the stuck watcher is told what it lost once it
/// reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_watcher_blocks_nothing() {
    use std::io::{Read, Write};
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    let tcp = world.tcp_server(9494);
    let (_, g) = guest_for(&c, "busy", opts(vec![])).await;
    // A watcher with a tiny receive buffer that never reads.
    let mut stuck =
        std::os::unix::net::UnixStream::connect(env.dir.join("run/org.cube.NetworkAgent")).unwrap();
    let call =
        json!({"method": "org.cube.NetworkAgent.WatchFlows", "parameters": {}, "more": true});
    let mut msg = call.to_string().into_bytes();
    msg.push(0);
    stuck.write_all(&msg).unwrap();
    // A live watcher of the busy sandbox, reading as it should.
    let follower = {
        let path = env.dir.join("run/org.cube.NetworkAgent");
        let port = tcp.port();
        std::thread::spawn(move || {
            let mut sock = std::os::unix::net::UnixStream::connect(path).unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            let call = json!({"method": "org.cube.NetworkAgent.WatchFlows",
                "parameters": {"sandbox_id": "busy"}, "more": true});
            let mut msg = call.to_string().into_bytes();
            msg.push(0);
            sock.write_all(&msg).unwrap();
            let (mut starts, mut lost, mut buf, mut byte) = (0, 0, vec![], [0u8; 1]);
            while starts < 300 {
                if sock.read(&mut byte).unwrap_or(0) != 1 {
                    break;
                }
                if byte[0] != 0 {
                    buf.push(byte[0]);
                    continue;
                }
                let v: Json = serde_json::from_slice(&buf).unwrap();
                buf.clear();
                let p = &v["parameters"];
                lost += p["lost"].as_u64().unwrap_or(0);
                if p["flow"]["event"] == "start" && p["flow"]["remote"]["port"] == port {
                    starts += 1;
                }
            }
            (starts, lost)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // Enough records to fill the stuck socket and its queue.
    let t0 = Instant::now();
    for i in 0..300 {
        let msg = format!("s{i}");
        assert_eq!(
            g.tcp_connect_send_recv(tcp, msg.as_bytes(), T).unwrap(),
            format!("world:{msg}").as_bytes()
        );
        if i % 50 == 0 {
            // The agent answers other calls meanwhile.
            c.ensure(&format!("other-{i}"), opts(vec![])).await.unwrap();
            c.release(&format!("other-{i}")).await.unwrap();
        }
    }
    eprintln!(
        "300 connections and 12 calls with a stuck watcher: {:?}",
        t0.elapsed()
    );
    // The live watcher saw them all, and lost nothing.
    let (starts, lost) = follower.join().unwrap();
    assert_eq!((starts, lost), (300, 0));
    // The stuck one reads again: records, and in time a loss report or
    // every record (no hang, valid JSON).
    stuck.set_read_timeout(Some(T)).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let n = stuck.read(&mut buf).unwrap();
    assert!(n > 0);
    let first = buf[..n].split(|b| *b == 0).next().unwrap();
    let v: Json = serde_json::from_slice(first).unwrap();
    assert!(
        v["parameters"].get("flow").is_some() || v["parameters"].get("lost").is_some(),
        "{v}"
    );
}

/// A paused sandbox's refused packets are records too (reason "paused"):
/// the world's connection to its mapping, and the node's to its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandboxs_refused_packets_are_recorded() {
    require_root!();
    let (env, _world) = node(&[]);
    let c = env.client().await;
    let net = c
        .ensure(
            "pz",
            opts(vec![
                ("port_mappings", ports(&[("tcp", 80, 0, "")])),
                ("paused", Value::from(true)),
            ]),
        )
        .await
        .unwrap();
    let host_port = mappings(&net)[0].2;
    let ns = format!("{}-w", env.ns);
    let short = Duration::from_millis(600);
    assert!(world::tcp_exchange_in(&ns, World::node_addr(host_port), b"in", short).is_err());
    let sandbox_ip: Ipv4Addr = common::s(&net, "sandbox_ip").parse().unwrap();
    assert!(
        world::tcp_exchange_in(&env.ns, SocketAddrV4::new(sandbox_ip, 80), b"host", short).is_err()
    );
    let flows = flows_until(&env, "pz", |f| {
        let paused = |d: &str| {
            f.iter()
                .any(|r| r["reason"] == "paused" && r["direction"] == d)
        };
        paused("ingress") && paused("host")
    });
    let ingress = flows
        .iter()
        .find(|r| r["reason"] == "paused" && r["direction"] == "ingress")
        .unwrap_or_else(|| panic!("{flows:?}"));
    assert_eq!(ingress["verdict"], "dropped");
    assert_eq!(ingress["guest"]["port"], 80);
    assert_eq!(n(&ingress["node"]["port"]), u64::from(host_port));
    assert!(
        flows
            .iter()
            .any(|r| r["reason"] == "paused" && r["direction"] == "host"),
        "{flows:?}"
    );
}

/// The ring is pinned: what the datapath records while the agent is down
/// (a flow's start, a refusal) is read by the next start, and a flow that
/// began before the restart ends with its whole totals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_made_while_the_agent_is_down_are_read_by_the_next_start() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    let tcp = world.tcp_server(9595);
    let (_, g) = guest_for(
        &c,
        "down",
        opts(vec![(
            "deny_out",
            Value::from(vec!["203.0.113.0/24".to_string()]),
        )]),
    )
    .await;
    drop(c);
    env.kill_agent();
    // The agent is gone: the datapath forwards and refuses on its own.
    let payload = vec![b'd'; 2000];
    assert_eq!(
        g.tcp_connect_send_recv(tcp, &payload, T).unwrap().len(),
        payload.len() + 6
    );
    let denied = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 8), 4545);
    assert!(
        g.tcp_connect_send_recv(denied, b"x", Duration::from_millis(600))
            .is_err()
    );
    env.start_agent();
    let flows = flows_until(&env, "down", |f| {
        !find(f, "start", "tcp", tcp.port()).is_empty()
            && !find(f, "end", "tcp", tcp.port()).is_empty()
            && !find(f, "refused", "tcp", 4545).is_empty()
    });
    let show = || serde_json::to_string_pretty(&flows).unwrap();
    assert_eq!(
        find(&flows, "start", "tcp", tcp.port()).len(),
        1,
        "{}",
        show()
    );
    assert!(
        !find(&flows, "refused", "tcp", 4545).is_empty(),
        "{}",
        show()
    );
    let end = find(&flows, "end", "tcp", tcp.port());
    assert_eq!(end.len(), 1, "{}", show());
    assert!(
        n(&end[0]["totals"]["bytes_out"]) >= payload.len() as u64,
        "{}",
        show()
    );
}
