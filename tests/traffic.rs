//! Per-sandbox traffic, exactly: a raw guest on the sandbox's TAP writes
//! frames of known sizes and reads what arrives; GetNetwork's `traffic`
//! (D-Bus and varlink) equals those sums from the sandbox's point of view
//! (`tx` = sent by it), a download moves `rx` and not `tx`, the counters
//! survive kill -9, the release logs the totals, and the next network
//! starts at zero. The agent runs in its own namespace facing a world
//! namespace (see tests/common).

mod common;

use std::collections::BTreeMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use common::guest::{
    self as guest, GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, eth_header, parse_ipv4, udp_frame,
};
use common::world::{self, World};
use common::{opts, ports};

/// GetNetwork's `traffic` over D-Bus.
async fn traffic(c: &common::Client, id: &str) -> std::collections::BTreeMap<String, u64> {
    c.traffic(id).await
}

/// The same over varlink (`varlinkctl`-free: the agent's socket, raw).
fn traffic_varlink(env: &common::Env, id: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let path = env.dir.join("run/org.cube.NetworkAgent");
    let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
    let call = serde_json::json!({
        "method": "org.cube.NetworkAgent.GetNetwork",
        "parameters": {"sandbox_id": id},
    });
    s.write_all(call.to_string().as_bytes()).unwrap();
    s.write_all(b"\0").unwrap();
    let mut buf = vec![];
    let mut byte = [0u8; 1];
    loop {
        s.read_exact(&mut byte).unwrap();
        if byte[0] == 0 {
            break;
        }
        buf.push(byte[0]);
    }
    let reply: serde_json::Value = serde_json::from_slice(&buf).unwrap();
    reply["parameters"]["network"]["traffic"].clone()
}

fn zeros(t: &BTreeMap<String, u64>) -> bool {
    ["tx_bytes", "tx_packets", "rx_bytes", "rx_packets"]
        .iter()
        .all(|k| t[*k] == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_is_counted_exactly_from_the_sandboxs_point_of_view() {
    require_root!();
    let (mut env, world) = world::node(&[]);
    let echo = world.udp_echo(0);
    let c = env.client().await;
    let net = c
        .ensure(
            "acct",
            opts(vec![("port_mappings", ports(&[("udp", 7400, 0, "")]))]),
        )
        .await
        .unwrap();
    let host_port = common::mappings(&net)[0].2;
    let t0 = traffic(&c, "acct").await;
    assert!(zeros(&t0), "a new network starts at zero: {t0:?}");
    let guest = RawGuest::new(c.open_tap("acct").await.unwrap());

    // Upload: N datagrams of S bytes to the world's echo, M answers back.
    const N: u64 = 10;
    const S: usize = 100;
    let src = SocketAddrV4::new(GUEST_IP, 40000);
    let mut sent_bytes = 0u64;
    for i in 0..N {
        let f = udp_frame(GUEST_MAC, GATEWAY_MAC, src, echo, &[b'a' + i as u8; S]);
        sent_bytes += f.len() as u64;
        guest.send(&f).unwrap();
    }
    assert_eq!(sent_bytes, N * (14 + 20 + 8 + S as u64));
    let mut got: Vec<Vec<u8>> = vec![];
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < N as usize && Instant::now() < deadline {
        got.extend(guest.recv(Duration::from_millis(200)));
    }
    let answers = got
        .iter()
        .filter(|f| parse_ipv4(f).is_some_and(|(from, _, p, _)| from == *echo.ip() && p == 17))
        .count();
    assert_eq!(answers, N as usize, "every datagram echoed: {got:?}");
    // Anything else that arrived counts too (it reached the sandbox).
    let recv_bytes: u64 = got.iter().map(|f| f.len() as u64).sum();
    let t = traffic(&c, "acct").await;
    assert_eq!(t["tx_packets"], N, "{t:?}");
    assert_eq!(t["tx_bytes"], sent_bytes, "{t:?}");
    assert_eq!(t["rx_packets"], got.len() as u64, "{t:?}");
    assert_eq!(t["rx_bytes"], recv_bytes, "{t:?}");
    assert_eq!((t["tx_dropped"], t["rx_dropped"]), (0, 0), "{t:?}");
    // The same numbers over varlink.
    let v = traffic_varlink(&env, "acct");
    for (k, want) in &t {
        if k != "flows" {
            assert_eq!(v[k].as_u64(), Some(*want), "varlink {k}: {v}");
        }
    }

    // Download: the world sends to the port mapping, the guest only reads.
    const D: u64 = 20;
    const DS: usize = 1000;
    world.run(move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..D {
            s.send_to(&[7u8; DS], World::node_addr(host_port)).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    let mut down: Vec<Vec<u8>> = vec![];
    let deadline = Instant::now() + Duration::from_secs(5);
    while down.len() < D as usize && Instant::now() < deadline {
        down.extend(guest.recv(Duration::from_millis(200)));
    }
    assert_eq!(down.len() as u64, D, "every datagram delivered");
    let down_bytes: u64 = down.iter().map(|f| f.len() as u64).sum();
    assert_eq!(down_bytes, D * (14 + 20 + 8 + DS as u64));
    let t2 = traffic(&c, "acct").await;
    assert_eq!(
        t2["tx_packets"], t["tx_packets"],
        "a download sends nothing"
    );
    assert_eq!(t2["tx_bytes"], t["tx_bytes"]);
    assert_eq!(t2["rx_packets"], t["rx_packets"] + D);
    assert_eq!(t2["rx_bytes"], t["rx_bytes"] + down_bytes);
    assert!(t2["rx_bytes"] > 10 * t2["tx_bytes"], "direction: {t2:?}");
    // Live flows: the upload's and the download's, counted by the reaper.
    let deadline = Instant::now() + Duration::from_secs(6);
    while traffic(&c, "acct").await["flows"] < 2 {
        assert!(Instant::now() < deadline, "{:?}", traffic(&c, "acct").await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Their IPv6 part: nothing so far; an echo request to the gateway's
    // fd63:7562:6500::5 and its answer are exactly it.
    let t2 = traffic(&c, "acct").await;
    let v6 = |t: &BTreeMap<String, u64>| {
        [
            "tx_bytes_ipv6",
            "tx_packets_ipv6",
            "rx_bytes_ipv6",
            "rx_packets_ipv6",
        ]
        .map(|k| t[k])
    };
    assert_eq!(v6(&t2), [0; 4], "{t2:?}");
    let echo6 = [128u8, 0, 0, 0, 0x12, 0x34, 0, 7, b'p', b'i', b'n', b'g'];
    let ping = guest::ip6_frame(
        GUEST_MAC,
        GATEWAY_MAC,
        guest::GUEST_IP6,
        guest::GATEWAY_IP6,
        58,
        64,
        &echo6,
    );
    guest.send(&ping).unwrap();
    let reply = guest
        .recv_match(Duration::from_secs(5), |f| {
            guest::parse_ip6(f).is_some_and(|p| p.l4[0] == 129)
        })
        .expect("no echo reply from the gateway");
    let t3 = traffic(&c, "acct").await;
    assert_eq!(
        v6(&t3),
        [ping.len() as u64, 1, reply.len() as u64, 1],
        "{t3:?}"
    );
    for k in ["tx_bytes", "rx_bytes", "tx_packets", "rx_packets"] {
        assert_eq!(t3[k] - t2[k], t3[&format!("{k}_ipv6")], "{k}: {t3:?}");
    }

    // The datapath's own counters: one flow each way, nothing dropped.
    let t2 = traffic(&c, "acct").await;
    assert_eq!(
        (t2["new_flows_snat"], t2["new_flows_portmap"]),
        (1, 1),
        "{t2:?}"
    );
    assert_eq!(t2["new_flows_host"], 0, "{t2:?}");
    let drops = [
        "drop_spoofed",
        "drop_policy",
        "drop_malformed",
        "drop_no_route",
        "drop_no_port",
        "drop_unsupported",
    ];
    for k in drops {
        assert_eq!(t2[k], 0, "{k}: {t2:?}");
    }
    // Each reason provoked once moves exactly its counter.
    let world_dst = echo;
    let mut spoofed_mac = GUEST_MAC;
    spoofed_mac[5] ^= 1;
    let mut bad_ip = eth_header(GATEWAY_MAC, GUEST_MAC, 0x0800);
    bad_ip.extend_from_slice(&[0x41; 20]); // version 4, header length 4 bytes
    // Neither IPv4, ARP nor IPv6 (IPv6 has its own link: docs/dual-stack.md).
    let mut other = eth_header(GATEWAY_MAC, GUEST_MAC, 0x88b5);
    other.extend_from_slice(&[0x60; 40]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "drop_spoofed",
            udp_frame(spoofed_mac, GATEWAY_MAC, src, world_dst, b"mac"),
        ),
        (
            "drop_spoofed",
            udp_frame(
                GUEST_MAC,
                GATEWAY_MAC,
                SocketAddrV4::new("169.254.68.7".parse().unwrap(), 40000),
                world_dst,
                b"ip",
            ),
        ),
        ("drop_malformed", bad_ip),
        ("drop_unsupported", other),
    ];
    let mut before = t2.clone();
    for (reason, frame) in cases {
        guest.send(&frame).unwrap();
        let deadline = Instant::now() + Duration::from_secs(3);
        let now = loop {
            let now = traffic(&c, "acct").await;
            if now[reason] > before[reason] || Instant::now() > deadline {
                break now;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        for k in drops {
            let want = before[k] + u64::from(k == reason);
            assert_eq!(now[k], want, "{reason} provoked: {k} {now:?}");
        }
        before = now;
    }
    // The policy: a sandbox that may not reach the world.
    c.ensure(
        "nopolicy",
        opts(vec![(
            "deny_out",
            zbus::zvariant::Value::from(vec!["0.0.0.0/0"]),
        )]),
    )
    .await
    .unwrap();
    let g2 = RawGuest::new(c.open_tap("nopolicy").await.unwrap());
    g2.send(&udp_frame(GUEST_MAC, GATEWAY_MAC, src, echo, b"denied"))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let p = loop {
        let p = traffic(&c, "nopolicy").await;
        if p["drop_policy"] > 0 || Instant::now() > deadline {
            break p;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(p["drop_policy"], 1, "{p:?}");
    assert_eq!(p["new_flows_snat"], 0, "{p:?}");
    assert_eq!(
        traffic(&c, "acct").await["drop_policy"],
        0,
        "another sandbox's drop"
    );
    drop(g2);
    assert!(c.release("nopolicy").await.unwrap());
    let t2 = traffic(&c, "acct").await;

    // kill -9: the counters live with the device (and the pinned map).
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    let t3 = traffic(&c, "acct").await;
    for k in ["tx_bytes", "tx_packets", "rx_bytes", "rx_packets"]
        .into_iter()
        .chain(drops)
        .chain(["new_flows_snat", "new_flows_portmap"])
    {
        assert_eq!(t3[k], t2[k], "{k} after kill -9: {t3:?}");
    }

    // Release: one log entry with the totals (journald fields
    // SANDBOX_ID=, TX_BYTES=, RX_BYTES=... under systemd).
    drop(guest);
    assert!(c.release("acct").await.unwrap());
    let log = env.log();
    let line = log
        .lines()
        .find(|l| l.contains("network released") && l.contains("sandbox_id=\"acct\""))
        .unwrap_or_else(|| panic!("no release entry:\n{log}"));
    for (k, v) in [
        ("tx_bytes", t2["tx_bytes"]),
        ("tx_packets", t2["tx_packets"]),
        ("rx_bytes", t2["rx_bytes"]),
        ("rx_packets", t2["rx_packets"]),
    ] {
        assert!(line.contains(&format!("{k}={v}")), "{k}={v} not in {line}");
    }

    // The next network starts at zero, whatever TAP it gets.
    c.ensure("next", opts(vec![])).await.unwrap();
    let t4 = traffic(&c, "next").await;
    assert!(zeros(&t4), "{t4:?}");
    assert!(
        t4.iter()
            .filter(|(k, _)| k.starts_with("drop_") || k.starts_with("new_flows_"))
            .all(|(_, v)| *v == 0),
        "{t4:?}"
    );
}
