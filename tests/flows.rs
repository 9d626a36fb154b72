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

/// Every reply of one `WatchFlows` call without follow (the kept records
/// of the last hour that `params` take).
fn watch_flows(env: &Env, mut params: Json) -> Vec<Json> {
    use std::io::{Read, Write};
    params["follow"] = json!(false);
    params["since_seconds"] = json!(3600);
    let mut sock =
        std::os::unix::net::UnixStream::connect(env.dir.join("run/org.cube.NetworkAgent")).unwrap();
    sock.set_read_timeout(Some(T)).unwrap();
    let call =
        json!({"method": "org.cube.NetworkAgent.WatchFlows", "parameters": params, "more": true});
    let mut msg = call.to_string().into_bytes();
    msg.push(0);
    sock.write_all(&msg).unwrap();
    let mut out = vec![];
    let mut buf = vec![];
    let mut byte = [0u8; 1];
    loop {
        assert_eq!(sock.read(&mut byte).unwrap(), 1, "stream ended early");
        if byte[0] != 0 {
            buf.push(byte[0]);
            continue;
        }
        let reply: Json = serde_json::from_slice(&buf).unwrap();
        buf.clear();
        assert!(reply.get("error").is_none(), "{reply}");
        let more = reply["continues"].as_bool().unwrap_or(false);
        out.push(reply["parameters"].clone());
        if !more {
            return out;
        }
    }
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

    let flows = flows_until(&env, "fl", |f| {
        !find(f, "end", "tcp", tcp.port()).is_empty() && !find(f, "refused", "tcp", 4444).is_empty()
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
