//! Upgrade and downgrade in place with two real builds: this tree's agent
//! and "the next release", a copy of the tree whose eBPF programs differ
//! (every program has another tag; tests/upgrade/build-next.sh builds it,
//! or `CNA_TEST_AGENT_NEXT` names one). A live guest counts datagrams both
//! ways through SNAT and a port mapping while builds replace each other,
//! and a TCP connection through a port mapping stays open throughout.
//! Then the map layouts: a flow table of an older layout is migrated, one
//! of an unknown layout stops the start and leaves the datapath running.
//! Root only.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::flow::Flow;
use common::guest::Guest;
use common::world::{self, World, node};
use common::{Client, Dict, Env, check, mappings, opts, ports};

const T: Duration = Duration::from_secs(5);
/// The guest's port of the long-lived UDP flow through SNAT.
const LONG_FLOW_PORT: u16 = 40000;

/// The next release's agent binary, built once per test run.
fn next_build() -> OsString {
    static NEXT: OnceLock<OsString> = OnceLock::new();
    NEXT.get_or_init(|| {
        if let Some(p) = std::env::var_os("CNA_TEST_AGENT_NEXT") {
            return p;
        }
        let dir = env!("CARGO_MANIFEST_DIR");
        let out = Command::new(format!("{dir}/tests/upgrade/build-next.sh"))
            .current_dir(dir)
            .output()
            .expect("running tests/upgrade/build-next.sh");
        assert!(
            out.status.success(),
            "building the next release failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        OsString::from(stdout.lines().last().expect("a path").trim())
    })
    .clone()
}

/// The running build's programs and tags, as Health states them.
fn claimed_tags(checks: &[(String, bool, String)]) -> BTreeMap<String, String> {
    let d = &check(checks, "datapath_programs").2;
    let list = d
        .strip_prefix("this build's programs: ")
        .and_then(|r| r.split(';').next())
        .unwrap_or_else(|| panic!("unexpected datapath_programs: {d}"));
    list.split(", ")
        .map(|p| {
            let (name, tag) = p.split_once(' ').unwrap();
            (name.to_owned(), tag.to_owned())
        })
        .collect()
}

/// Every tc program attached in the node's namespace, read with bpftool:
/// (device, hook) -> (program name, tag).
fn attached(env: &Env) -> BTreeMap<(String, String), (String, String)> {
    let net: serde_json::Value =
        serde_json::from_str(&env.ns_cmd(&["bpftool", "-j", "net", "show"])).unwrap();
    let mut out = BTreeMap::new();
    for e in net[0]["tc"].as_array().expect("bpftool net: a tc list") {
        let id = e["id"].as_u64().unwrap().to_string();
        let prog: serde_json::Value =
            serde_json::from_str(&env.ns_cmd(&["bpftool", "-j", "prog", "show", "id", &id]))
                .unwrap();
        out.insert(
            (
                e["devname"].as_str().unwrap().to_owned(),
                e["kind"].as_str().unwrap().to_owned(),
            ),
            (
                e["name"].as_str().unwrap().to_owned(),
                prog["tag"].as_str().unwrap().to_owned(),
            ),
        );
    }
    out
}

/// Every attached program is one of `tags` (the running build's), and
/// every hook the datapath needs is there.
fn assert_runs(env: &Env, tags: &BTreeMap<String, String>, taps: &[String], when: &str) {
    let got = attached(env);
    for ((dev, kind), (name, tag)) in &got {
        assert_eq!(
            tags.get(name),
            Some(tag),
            "{when}: {dev} {kind} runs {name} tag {tag}, not the running build's {tags:?}"
        );
    }
    let mut want: Vec<(String, &str, &str)> = vec![
        ("lo".into(), "clsact/egress", "from_host"),
        ("cube-dev".into(), "clsact/egress", "to_sandbox_ip"),
        (world::UPLINK.into(), "clsact/ingress", "from_uplink"),
        (world::UPLINK.into(), "clsact/egress", "to_uplink"),
    ];
    want.extend(
        taps.iter()
            .map(|t| (t.clone(), "clsact/ingress", "from_guest")),
    );
    for (dev, kind, name) in want {
        assert_eq!(
            got.get(&(dev.clone(), kind.to_owned()))
                .map(|p| p.0.as_str()),
            Some(name),
            "{when}: no {name} on {dev} {kind}: {got:?}"
        );
    }
}

fn tcp_roundtrip(s: &mut TcpStream, msg: &str) {
    s.write_all(msg.as_bytes()).unwrap();
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf).unwrap_or_else(|e| {
        panic!("the TCP connection through the port mapping broke at {msg}: {e}")
    });
    assert_eq!(buf, msg.as_bytes());
}

async fn networks(c: &Client, ids: &[&str]) -> Vec<Dict> {
    let mut out = vec![];
    for id in ids {
        // The traffic counters move with the guest's flows.
        let mut net = c.get(id).await.unwrap();
        assert!(net.remove("traffic").is_some());
        out.push(net);
    }
    out
}

fn host_port(net: &Dict, proto: &str) -> u16 {
    mappings(net)
        .into_iter()
        .find(|m| m.0 == proto)
        .unwrap_or_else(|| panic!("no {proto} mapping"))
        .2
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_downgrade_in_place_keep_every_flow() {
    require_root!();
    let next = next_build();
    let this = common::agent_binary();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    let live = c
        .ensure(
            "live",
            // Limited both ways: every datagram below goes through the
            // shapers, which an upgrade keeps.
            opts(vec![
                (
                    "port_mappings",
                    ports(&[("udp", 7000, 0, ""), ("tcp", 8000, 0, "")]),
                ),
                ("egress_bps", zbus::zvariant::Value::from(100_000_000u64)),
                ("ingress_bps", zbus::zvariant::Value::from(100_000_000u64)),
            ]),
        )
        .await
        .unwrap();
    let (udp_port, tcp_port) = (host_port(&live, "udp"), host_port(&live, "tcp"));
    // "b" hands its TAP over by name (tap_owner_uid): its guest opens the
    // device itself, and no build may ever open it.
    let byname = c
        .ensure(
            "b",
            opts(vec![
                ("port_mappings", ports(&[("udp", 7000, 0, "")])),
                ("tap_owner_uid", zbus::zvariant::Value::from(0u32)),
            ]),
        )
        .await
        .unwrap();
    let (b_tap, b_port) = (common::s(&byname, "tap_name"), host_port(&byname, "udp"));
    // "c" has egress rules (issue 46): the record with its secret and the
    // datapath's DP_F_RULES survive every switch (GetNetwork compared
    // below shows them, digests only).
    let rule: std::collections::HashMap<&str, zbus::zvariant::Value<'_>> = [
        ("host", zbus::zvariant::Value::from("api.example.com")),
        (
            "set_headers",
            zbus::zvariant::Value::from(std::collections::HashMap::from([(
                "Authorization".to_string(),
                "Bearer upgrade-secret".to_string(),
            )])),
        ),
    ]
    .into();
    c.ensure(
        "c",
        opts(vec![
            ("port_mappings", ports(&[("udp", 53, 0, "")])),
            ("egress_rules", zbus::zvariant::Value::from(vec![rule])),
        ]),
    )
    .await
    .unwrap();
    let ids = ["live", "b", "c"];
    let before = networks(&c, &ids).await;
    let shown = format!("{:?}", before[2]["egress_rules"]);
    assert!(
        shown.contains("sha256:") && !shown.contains("upgrade-secret"),
        "{shown}"
    );
    let taps: Vec<String> = before.iter().map(|n| common::s(n, "tap_name")).collect();
    let g = Arc::new(Guest::start_default(c.open_tap("live").await.unwrap()));
    g.udp_echo(7000).unwrap();
    g.tcp_echo(8000).unwrap();
    let echo = world.udp_echo(5454);
    assert_eq!(
        g.udp_exchange(Some(LONG_FLOW_PORT), echo, b"warm", T)
            .unwrap()
            .0,
        b"world:warm"
    );
    let mut tcp = world::in_netns(&world.ns, move || {
        TcpStream::connect_timeout(&World::node_addr(tcp_port).into(), T)
    })
    .expect("TCP through the port mapping");
    tcp.set_read_timeout(Some(T)).unwrap();
    tcp_roundtrip(&mut tcp, "before");
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    let this_tags = claimed_tags(&checks);
    assert_runs(&env, &this_tags, &taps, "this build at start");
    drop(c);

    let b_fd = {
        let name = b_tap.clone();
        world::in_netns(&env.ns, move || {
            cube_network_agent::tap::Tap::open_existing(&name)
                .and_then(|t| t.dup())
                .expect("opening the by-name TAP as its owner")
        })
    };
    let gb = Arc::new(Guest::start_default(b_fd));
    gb.udp_echo(7000).unwrap();
    let flow = Flow::start(g.clone(), echo, &world.ns, udp_port, Some(LONG_FLOW_PORT));
    // Its own echo: the SNAT port check below counts 5454's peers.
    let echo_b = world.udp_echo(5455);
    let flow_b = Flow::start(gb.clone(), echo_b, &world.ns, b_port, None);
    let mut next_tags = None;
    for (step, (clean, to, name)) in [
        (true, &next, "SIGTERM this build, start the next"),
        (
            false,
            &this,
            "SIGKILL the next build, start this one (downgrade)",
        ),
        (false, &next, "SIGKILL this build, start the next"),
    ]
    .into_iter()
    .enumerate()
    {
        std::thread::sleep(Duration::from_millis(400));
        if clean {
            assert!(env.stop_agent().success(), "{}", env.log());
        } else {
            env.kill_agent();
        }
        env.binary = Some(to.clone());
        env.start_agent();
        let c = env.client().await;
        let (ok, checks) = c.health().await;
        assert!(ok, "{name}: {checks:#?}");
        let tags = claimed_tags(&checks);
        if *to == next {
            assert!(
                tags.values().all(|t| !this_tags.values().any(|o| o == t)),
                "the two builds must differ in every program: {this_tags:?} {tags:?}"
            );
            if let Some(n) = &next_tags {
                assert_eq!(&tags, n, "{name}");
            }
            next_tags = Some(tags.clone());
        } else {
            assert_eq!(tags, this_tags, "{name}");
        }
        // At READY every hook already runs the started build's programs.
        assert_runs(&env, &tags, &taps, name);
        assert_eq!(
            networks(&c, &ids).await,
            before,
            "{name}: GetNetwork changed"
        );
        tcp_roundtrip(&mut tcp, &format!("step{step}"));
        eprintln!("{name}: ok, {}", check(&checks, "datapath_programs").2);
    }
    std::thread::sleep(Duration::from_millis(400));
    let ((e_sent, e_back), (i_sent, i_back)) = flow.finish();
    eprintln!("egress {e_back}/{e_sent}, ingress {i_back}/{i_sent} across 3 build switches");
    assert!(e_sent > 20 && i_sent > 100, "{e_sent} {i_sent}");
    assert_eq!(e_back, e_sent, "guest -> world datagrams lost");
    assert_eq!(i_back, i_sent, "world -> host port -> guest datagrams lost");
    let ((e_sent, e_back), (i_sent, i_back)) = flow_b.finish();
    eprintln!("by name: egress {e_back}/{e_sent}, ingress {i_back}/{i_sent}");
    assert!(e_sent > 20 && i_sent > 100, "{e_sent} {i_sent}");
    assert_eq!(
        (e_back, i_back),
        (e_sent, i_sent),
        "the by-name guest lost datagrams"
    );
    let me = std::process::id();
    assert_eq!(
        common::tap_holders(&b_tap),
        [me],
        "only the by-name guest (this test) holds {b_tap}"
    );
    // The long flow kept its SNAT port through every switch.
    let snat: BTreeSet<u16> = world.peers(5454).iter().map(|p| p.port()).collect();
    assert_eq!(
        snat.len(),
        1,
        "the long flow changed its SNAT port: {snat:?}"
    );
    tcp_roundtrip(&mut tcp, "after");
    let t = env.client().await.traffic("live").await;
    assert!(
        t["egress_shaped_packets"] > 0 && t["ingress_shaped_packets"] > 0,
        "the limits were not in force after the switches: {t:?}"
    );
}

/// Creates a map pin with bpftool.
fn create_pin(env: &Env, path: &str, kind: &str, key: u32, value: u32, entries: u32, name: &str) {
    env.ns_cmd(&[
        "bpftool",
        "map",
        "create",
        path,
        "type",
        kind,
        "key",
        &key.to_string(),
        "value",
        &value.to_string(),
        "entries",
        &entries.to_string(),
        "name",
        name,
    ]);
}

/// (key bytes, value bytes) of every entry of a pinned map.
fn dump(env: &Env, path: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let v: serde_json::Value =
        serde_json::from_str(&env.ns_cmd(&["bpftool", "-j", "map", "dump", "pinned", path]))
            .unwrap();
    let bytes = |a: &serde_json::Value| -> Vec<u8> {
        a.as_array()
            .unwrap()
            .iter()
            .map(|b| u8::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap())
            .collect()
    };
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| (bytes(&e["key"]), bytes(&e["value"])))
        .collect()
}

/// Replaces the pinned map `name` (of `kind`, `key`-byte keys, `value`-byte
/// values) with one of an older layout: `old_value`-byte values, each
/// entry's value cut to that. Returns the entries as they were.
fn repin_older(
    env: &Env,
    name: &str,
    kind: &str,
    key: u32,
    value: usize,
    old_value: u32,
    entries: u32,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let bpf = env.dir.join("bpf");
    let live = bpf.join(name).display().to_string();
    let older = bpf.join(format!("{name}_v1")).display().to_string();
    let was = dump(env, &live);
    create_pin(env, &older, kind, key, old_value, entries, name);
    for (k, v) in &was {
        assert_eq!(v.len(), value);
        let mut args = vec![
            "bpftool".to_owned(),
            "map".into(),
            "update".into(),
            "pinned".into(),
            older.clone(),
            "key".into(),
            "hex".into(),
        ];
        args.extend(hex(k));
        args.extend(["value".into(), "hex".into()]);
        args.extend(hex(&v[..old_value as usize]));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        env.ns_cmd(&a);
    }
    std::fs::rename(&older, &live).unwrap();
    assert_eq!(common::pin_value_size(&live), u64::from(old_value));
    was
}

/// The per-sandbox counters of the builds before `drop_stale_tcp` (nine
/// counters, 72 bytes) and before their IPv6 parts (ten, 80 bytes) keep
/// their values and gain the new ones at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_counters_of_the_older_layout_are_migrated() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("s", opts(vec![])).await.unwrap();
    let g = Guest::start_default(c.open_tap("s").await.unwrap());
    let echo = world.udp_echo(5858);
    for p in [40001, 40002, 40003] {
        g.udp_exchange(Some(p), echo, b"x", T).unwrap();
    }
    let before = c.traffic("s").await;
    assert_eq!(before["new_flows_snat"], 3, "{before:?}");
    let mut c = c;
    let mut flows = 3;
    // Before drop_stale_tcp (72), before the IPv6 parts (80), before the
    // flow log's token bucket (160).
    for old in [72u32, 80, 160] {
        drop(c);
        env.kill_agent();
        let entries = repin_older(&env, "sb_stats", "hash", 4, 192, old, 65536);
        assert!(!entries.is_empty(), "no sb_stats entry");

        let was = format!("Hash, key 4 B, value {old} B");
        (c, _) = start_migrating(&mut env, "sb_stats", &was, 192).await;
        let after = c.traffic("s").await;
        assert_eq!(after["new_flows_snat"], flows, "{after:?}");
        assert_eq!(after["drop_stale_tcp"], 0, "{after:?}");
        assert_eq!(after["new_flows_snat_ipv6"], 0, "{after:?}");
        // And the migrated entry counts on.
        flows += 1;
        g.udp_exchange(Some(40000 + flows as u16), echo, b"y", T)
            .unwrap();
        assert_eq!(c.traffic("s").await["new_flows_snat"], flows);
    }
}

/// Starts the agent again, which must migrate the pinned map `name` from
/// the older layout `was` (as Health's datapath_pins names it) to values
/// of `now` bytes and remove the old pin, healthy; a client, and the map's
/// entries then.
async fn start_migrating(
    env: &mut Env,
    name: &str,
    was: &str,
    now: u64,
) -> (Client, BTreeMap<Vec<u8>, Vec<u8>>) {
    env.start_agent();
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    let pins = &check(&checks, "datapath_pins").2;
    assert!(
        pins.contains(&format!("{name} migrated (was {was}")),
        "{pins}"
    );
    let bpf = env.dir.join("bpf");
    let pin = bpf.join(name).display().to_string();
    assert_eq!(
        common::pin_value_size(&pin),
        now,
        "{name} has this build's layout"
    );
    assert!(
        !bpf.join(format!("{name}_old")).exists(),
        "the old pin was removed"
    );
    (c, dump(env, &pin).into_iter().collect())
}

fn hex(b: &[u8]) -> Vec<String> {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_table_of_the_older_layout_is_migrated_with_its_flows() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("m", opts(vec![])).await.unwrap();
    let g = Guest::start_default(c.open_tap("m").await.unwrap());
    let echo = world.udp_echo(5656);
    g.udp_exchange(Some(LONG_FLOW_PORT), echo, b"one", T)
        .unwrap();
    drop(c);
    env.kill_agent();
    // Rewrite the pinned flow table as the builds up to d04b209 had it:
    // 24-byte values (no seq_last/pad, local_addr where ts_last is).
    let bpf = env.dir.join("bpf");
    let ct = bpf.join("ct").display().to_string();
    let entries = repin_older(&env, "ct", "lru_hash", 16, 64, 24, 262144);
    assert!(!entries.is_empty(), "no flow in ct");
    assert_eq!(common::pin_value_size(&ct), 24);

    let (c, migrated) = start_migrating(&mut env, "ct", "LruHash, key 16 B, value 24 B", 64).await;
    // Every flow arrived, with its SNAT port, generation and timestamps.
    for (k, v) in &entries {
        let m = migrated
            .get(k)
            .unwrap_or_else(|| panic!("flow {k:?} not migrated"));
        assert_eq!(m[..12], v[..12], "last_seen, SNAT port, kind, state");
        assert_eq!(m[16..24], v[16..24], "generation");
        assert_eq!(m[32..], [0; 32], "no flow-log totals");
    }
    // The builds before the flow log: 32-byte values, carried over whole
    // with zero totals appended.
    drop(c);
    env.kill_agent();
    let entries = repin_older(&env, "ct", "lru_hash", 16, 64, 32, 262144);
    let (_, migrated) = start_migrating(&mut env, "ct", "LruHash, key 16 B, value 32 B", 64).await;
    for (k, v) in &entries {
        let m = migrated
            .get(k)
            .unwrap_or_else(|| panic!("flow {k:?} not migrated"));
        assert_eq!(m[..32], v[..32], "the whole older value");
        assert_eq!(m[32..], [0; 32], "totals from the upgrade on");
    }
    // And the flow goes on with the same SNAT port.
    g.udp_exchange(Some(LONG_FLOW_PORT), echo, b"two", T)
        .unwrap();
    let snat: BTreeSet<u16> = world.peers(5656).iter().map(|p| p.port()).collect();
    assert_eq!(snat.len(), 1, "{snat:?}");
}

/// Host flows of the builds before IPv6 steering (`hflow` with 32-byte
/// values) are carried over, each gaining an empty IPv6 peer, and go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_flows_of_the_older_layout_are_migrated() {
    require_root!();
    let (mut env, _world) = node(&[]);
    let c = env.client().await;
    c.ensure("h", opts(vec![])).await.unwrap();
    let g = Guest::start_default(c.open_tap("h").await.unwrap());
    let host = common::world::Server::udp(
        &env.ns,
        std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 0),
        b"node:",
    );
    let gw = std::net::SocketAddrV4::new(common::guest::GATEWAY_IP, host.addr.port());
    g.udp_exchange(Some(LONG_FLOW_PORT), gw, b"one", T).unwrap();
    drop(c);
    env.kill_agent();
    let entries = repin_older(&env, "hflow", "hash", 16, 48, 32, 262144);
    assert!(!entries.is_empty(), "no host flow");

    let (_, migrated) = start_migrating(&mut env, "hflow", "Hash, key 16 B, value 32 B", 48).await;
    for (k, v) in &entries {
        let m = migrated
            .get(k)
            .unwrap_or_else(|| panic!("host flow {k:?} not migrated"));
        assert_eq!(
            m[8..32],
            v[8..32],
            "generation, sandbox, ports, kind, state, flags"
        );
        assert_eq!(m[32..], [0; 16], "no IPv6 peer");
    }
    g.udp_exchange(Some(LONG_FLOW_PORT), gw, b"two", T).unwrap();
    let ports: BTreeSet<u16> = host.peers().iter().map(|p| p.port()).collect();
    assert_eq!(
        ports,
        BTreeSet::from([LONG_FLOW_PORT]),
        "{:?}",
        host.peers()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_it_cannot_migrate_stops_the_start_and_the_datapath_keeps_running() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("r", opts(vec![])).await.unwrap();
    let g = Guest::start_default(c.open_tap("r").await.unwrap());
    let echo = world.udp_echo(5757);
    assert_eq!(g.udp_send_recv(echo, b"a", T).unwrap(), b"world:a");
    drop(c);
    env.kill_agent();
    // A `sandboxes` map as a newer build might pin it.
    let bpf = env.dir.join("bpf");
    let pin = bpf.join("sandboxes");
    let aside = bpf.join("sandboxes_mine");
    std::fs::rename(&pin, &aside).unwrap();
    create_pin(
        &env,
        &pin.display().to_string(),
        "hash",
        4,
        99,
        65536,
        "sandboxes",
    );
    let before: BTreeSet<String> = std::fs::read_dir(&bpf)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let (status, log) = env
        .try_start_agent()
        .expect_err("the start must be refused");
    assert!(!status.success());
    assert!(
        log.contains("sandboxes has layout (Hash, key 4 B, value 99 B, 65536 entries)")
            && log.contains("cannot migrate it")
            && log.contains("Nothing was changed"),
        "{log}"
    );
    // Nothing changed: the pins, and the datapath still forwards.
    let after: BTreeSet<String> = std::fs::read_dir(&bpf)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(before, after);
    assert_eq!(g.udp_send_recv(echo, b"b", T).unwrap(), b"world:b");
    // Put back, the agent starts and the network is still there.
    std::fs::remove_file(&pin).unwrap();
    std::fs::rename(&aside, &pin).unwrap();
    env.start_agent();
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert_eq!(g.udp_send_recv(echo, b"c", T).unwrap(), b"world:c");
}

/// Deny entries an older build wrote (value 1 for every deny, which now
/// means the catch-all) get the value their prefix calls for at the next
/// start, so a learned address never passes a narrow deny after an
/// upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_entries_of_an_older_build_are_rewritten_at_start() {
    require_root!();
    let mut env = Env::new(&[]);
    let c = env.client().await;
    let deny = zbus::zvariant::Value::from(vec!["0.0.0.0/0".to_string(), "10.0.0.0/8".to_string()]);
    c.ensure(
        "old-deny",
        opts(vec![
            (
                "allow_out",
                zbus::zvariant::Value::from(vec!["*.allowed.test".to_string()]),
            ),
            ("deny_out", deny),
        ]),
    )
    .await
    .unwrap();
    drop(c);
    env.kill_agent();
    let path = env.dir.join("bpf").join("policy_deny");
    let path = path.to_str().unwrap();
    let values = |env: &Env| -> Vec<(u32, u8)> {
        let mut v: Vec<(u32, u8)> = dump(env, path)
            .into_iter()
            .map(|(k, v)| (u32::from_ne_bytes(k[..4].try_into().unwrap()), v[0]))
            .collect();
        v.sort();
        v
    };
    assert_eq!(values(&env), vec![(32, 1), (40, 2)], "this build's values");
    // What an older build left: 1 everywhere.
    for (k, _) in dump(&env, path) {
        let mut args = vec!["bpftool", "map", "update", "pinned", path, "key"];
        let key: Vec<String> = k.iter().map(|b| b.to_string()).collect();
        args.extend(key.iter().map(String::as_str));
        args.extend(["value", "1"]);
        env.ns_cmd(&args);
    }
    assert_eq!(values(&env), vec![(32, 1), (40, 1)]);
    env.start_agent();
    assert_eq!(values(&env), vec![(32, 1), (40, 2)], "rewritten at start");
}
