//! cube-cni end to end: the raw protocol (env + stdin) for every verb and
//! error code, a real libcni client (tests/cni/cnirun, Debian's libcni
//! 1.1.2 and go-cni 1.1.7) with a chained stock plugin, a real runtime
//! (containerd 1.6 + `ctr run --cni`), restart continuity across kill -9,
//! and Kata's tcfilter model on top of the veth. The agent runs in its own
//! node namespace facing a world namespace; every container namespace is
//! made here and deleted even on failure.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::ctr::{Ctr, Out, cni, cni_ro_sys};
use common::world::{self, NODE_IP, Server, World, in_netns};
use common::{Env, opts, s};
use serde_json::{Value, json};

const GUEST: &str = "169.254.68.6/30";
const GATEWAY: &str = "169.254.68.5";

fn conf(env: &Env, version: &str, extra: Value) -> Value {
    let mut c = json!({
        "cniVersion": version,
        "name": "cube",
        "type": "cube-cni",
        "dbusAddress": env.address,
        "timeoutMs": 3000,
    });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        c[k] = v;
    }
    c
}

fn verb(env: &Env, command: &str, cid: &str, ctr: Option<&Ctr>, conf: &Value) -> Out {
    let netns = ctr.map(Ctr::path).unwrap_or_default();
    cni(
        env,
        &[
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", cid),
            ("CNI_NETNS", &netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ],
        conf.to_string().as_bytes(),
    )
}

fn add_ok(env: &Env, cid: &str, ctr: &Ctr, conf: &Value) -> Value {
    let out = verb(env, "ADD", cid, Some(ctr), conf);
    assert!(out.ok, "ADD {cid} failed: {out:?}");
    out.json
}

/// The in-container view: (addresses of eth0, default gateway, eth0 up).
fn inside(ctr: &Ctr) -> (Vec<String>, Option<String>, bool) {
    let links = ctr.ip_json(&["addr", "show", "dev", "eth0"]);
    let link = &links[0];
    let addrs = link["addr_info"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|x| x["family"] == "inet")
                .map(|x| format!("{}/{}", x["local"].as_str().unwrap(), x["prefixlen"]))
                .collect()
        })
        .unwrap_or_default();
    let up = link["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "UP"));
    let routes = ctr.ip_json(&["route", "show", "default"]);
    let gw = routes[0]["gateway"].as_str().map(str::to_owned);
    (addrs, gw, up)
}

/// Host ends of released CNI networks waiting for the pool's batched
/// deletion (`ctapx…`).
fn retired_links(env: &Env) -> Vec<String> {
    env.links()
        .into_iter()
        .filter(|(n, l)| l.kind == "veth" && n.starts_with("ctapx"))
        .map(|(n, _)| n)
        .collect()
}

/// Released veths are deleted off the reply path, within a few seconds.
fn wait_retired_gone(env: &Env) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !retired_links(env).is_empty() {
        assert!(
            Instant::now() < deadline,
            "retired veths not deleted: {:?}",
            retired_links(env)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_every_verb_and_error() {
    require_root!();
    let (mut env, world) = world::node(&[]);
    let c = env.client().await;
    let echo = world.udp_echo(0);

    // Run by hand (no CNI_COMMAND), like the reference plugins: what it is
    // and the versions it speaks, exit 0.
    for args in [&["--version"][..], &["--help"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_cube-cni"))
            .args(args)
            .env_remove("CNI_COMMAND")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert!(
            text.starts_with("CNI cube-cni plugin v")
                && text
                    .contains("CNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"),
            "{args:?}: {text}"
        );
    }

    // VERSION: no agent needed; echoes the caller's version.
    let v = cni(
        &env,
        &[("CNI_COMMAND", "VERSION")],
        br#"{"cniVersion":"0.4.0"}"#,
    );
    assert!(v.ok, "{v:?}");
    assert_eq!(v.json["cniVersion"], "0.4.0");
    for want in ["0.4.0", "1.0.0", "1.1.0"] {
        assert!(
            v.json["supportedVersions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x == want),
            "{v:?}"
        );
    }

    // ADD in each version: result shape, the namespace, the agent's view.
    let mut pod_ips = vec![];
    for (i, version) in ["1.1.0", "1.0.0", "0.4.0"].iter().enumerate() {
        let ctr = Ctr::new(&format!("v{i}"));
        let cid = format!("ver{i}");
        let cf = conf(&env, version, json!({}));
        if i == 1 {
            // A namespace whose new interfaces ignore RAs still gets the
            // address the result lists (ADD adds it, not SLAAC).
            ctr.sh("sysctl -qw net.ipv6.conf.default.accept_ra=0");
        }
        let r = if i == 2 {
            // /proc/sys read-only, as a runtime in a systemd container
            // runs its plugins: the sysctls are refinements, ADD works.
            let out = cni_ro_sys(
                &env,
                &[
                    ("CNI_COMMAND", "ADD"),
                    ("CNI_CONTAINERID", &cid),
                    ("CNI_NETNS", &ctr.path()),
                    ("CNI_IFNAME", "eth0"),
                    ("CNI_PATH", "/opt/cni/bin"),
                ],
                cf.to_string().as_bytes(),
            );
            assert!(out.ok && out.stderr.contains("read-only"), "{out:?}");
            out.json
        } else {
            add_ok(&env, &cid, &ctr, &cf)
        };
        assert_eq!(r["cniVersion"], *version);
        let ifs = r["interfaces"].as_array().unwrap();
        assert_eq!(ifs.len(), 2, "{r}");
        assert_eq!(ifs[1]["name"], "eth0");
        assert_eq!(ifs[1]["sandbox"], ctr.path());
        assert_eq!(ifs[1]["mac"], "20:90:6f:fc:fc:fc");
        assert_eq!(ifs[1].get("mtu").is_some(), *version == "1.1.0", "{r}");
        let net = c.get(&format!("cni:{cid}:eth0")).await.unwrap();
        let pod_ip = format!("{}/32", s(&net, "sandbox_ip"));
        assert_eq!(r["ips"][0]["address"], pod_ip.as_str(), "pod IP first: {r}");
        assert!(r["ips"][0].get("interface").is_none());
        assert_eq!(r["ips"][1]["address"], GUEST);
        assert_eq!(r["ips"][1]["gateway"], GATEWAY);
        assert_eq!(r["ips"][1]["interface"], 1);
        assert_eq!(r["ips"][0].get("version").is_some(), *version == "0.4.0");
        assert_eq!(r["routes"][0]["dst"], "0.0.0.0/0");
        assert_eq!(s(&net, "attach"), "veth");
        assert_eq!(s(&net, "ifname"), "eth0");
        let meta: std::collections::HashMap<String, String> =
            net["metadata"].try_clone().unwrap().try_into().unwrap();
        assert_eq!(meta["cni.network"], "cube");
        assert_eq!(meta["cni.container_id"], cid);
        assert_eq!(meta["cni.netns"], ctr.path());
        let (addrs, gw, up) = inside(&ctr);
        assert_eq!(addrs, vec![GUEST.to_string()]);
        assert_eq!(gw.as_deref(), Some(GATEWAY));
        assert!(up);
        // IPv6 as a VM guest has it: the interface keeps IPv6, has its
        // SLAAC address usable when ADD returns (no default route: this
        // node has no IPv6 egress), and none of its IPv6 (router
        // solicitations, MLD) is dropped as unsupported (below). The
        // result lists the pod's IPv6 (the sandbox's node-side identity,
        // no interface) before the container's own (the same in every
        // container): CRI takes the first of each family (docs/cni.md).
        assert_eq!(
            ctr.sh("cat /proc/sys/net/ipv6/conf/eth0/addr_gen_mode")
                .trim(),
            "0"
        );
        let slaac = "fd63:7562:6500:0:2290:6fff:fefc:fcfc";
        let ips = r["ips"].as_array().unwrap();
        assert_eq!(ips.len(), 4, "{r}");
        assert_eq!(
            ips[2]["address"],
            format!("{}/128", s(&net, "sandbox_ipv6")),
            "{r}"
        );
        assert!(ips[2].get("interface").is_none(), "{r}");
        assert_eq!(ips[3]["address"], format!("{slaac}/64"), "{r}");
        assert_eq!(ips[3]["gateway"], "fe80::2290:6fff:fecf:cfcf", "{r}");
        assert_eq!(ips[3]["interface"], 1, "{r}");
        assert_eq!(ips[2].get("version").is_some(), *version == "0.4.0");
        assert_eq!(r["routes"].as_array().unwrap().len(), 1, "{r}");
        let global = ctr.sh("ip -6 addr show dev eth0 scope global");
        assert!(
            global.contains(slaac) && !global.contains("tentative"),
            "no usable SLAAC address at once: {}",
            ctr.sh("ip -6 addr")
        );
        assert_eq!(ctr.sh("ip -6 route show default").trim(), "");
        if i == 0 {
            std::thread::sleep(Duration::from_millis(1500));
            let t = c.traffic(&format!("cni:{cid}:eth0")).await;
            assert_eq!(t.get("drop_unsupported").copied().unwrap_or(0), 0, "{t:?}");
        }
        pod_ips.push(pod_ip);
        // The container reaches the world through SNAT (the world sees
        // the node's address).
        let got = world::udp_exchange_in(&ctr.name, echo, b"hi", Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("container -> world: {e}"));
        assert_eq!(got, b"world:hi");
        assert!(
            world
                .peers(echo.port())
                .iter()
                .all(|p| p.ip() == std::net::IpAddr::V4(NODE_IP)),
            "{:?}",
            world.peers(echo.port())
        );
        let del = verb(&env, "DEL", &cid, Some(&ctr), &cf);
        assert!(del.ok && del.json.is_null(), "{del:?}");
    }
    pod_ips.dedup();
    assert_eq!(pod_ips.len(), 3, "pod IPs must differ: {pod_ips:?}");

    let cf = conf(&env, "1.0.0", json!({}));
    let a = Ctr::new("a");
    let r = add_ok(&env, "a", &a, &cf);
    // The host reaches the container at its pod IP.
    let pod = r["ips"][0]["address"]
        .as_str()
        .unwrap()
        .trim_end_matches("/32");
    let pod: Ipv4Addr = pod.parse().unwrap();
    let _srv = Server::tcp(
        &a.name,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7000),
        b"ctr:",
    );
    let got = world::tcp_exchange_in(
        &env.ns,
        SocketAddrV4::new(pod, 7000),
        b"x",
        Duration::from_secs(3),
    )
    .unwrap();
    assert_eq!(got, b"ctr:x");

    // cubenetctl list names the attachment.
    let out = Command::new(env!("CARGO_BIN_EXE_cubenetctl"))
        .args(["--bus", &env.address, "list"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().next().unwrap_or("").contains("CNI"), "{text}");
    assert!(
        text.contains(&format!("a/eth0@{}", a.path())),
        "cubenetctl list: {text}"
    );

    // A second ADD of a live attachment is an error and changes nothing.
    let again = verb(&env, "ADD", "a", Some(&a), &cf);
    assert!(!again.ok);
    assert_eq!(again.code(), 104, "{again:?}");
    assert_eq!(c.list().await.len(), 1);

    // CHECK: ok, then fails when the interface is down, ok again.
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert!(chk.ok, "{chk:?}");
    a.sh("ip link set eth0 down");
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert_eq!(chk.code(), 105, "{chk:?}");
    assert!(chk.json["msg"].as_str().unwrap().contains("down"));
    a.sh("ip link set eth0 up");
    a.sh("ip route replace default via 169.254.68.5 dev eth0");
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert!(chk.ok, "{chk:?}");
    // The IPv6 address the result listed is checked too.
    let slaac = "fd63:7562:6500:0:2290:6fff:fefc:fcfc/64";
    a.sh(&format!("ip -6 addr del {slaac} dev eth0"));
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert_eq!(chk.code(), 105, "{chk:?}");
    assert!(
        chk.json["msg"].as_str().unwrap().contains("IPv6"),
        "{chk:?}"
    );
    a.sh(&format!("ip -6 addr add {slaac} dev eth0 nodad"));
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert!(chk.ok, "{chk:?}");
    // The datapath's filter is a dependency CHECK verifies (and the agent
    // repairs): removed by hand, CHECK still passes after the repair.
    let host_end = s(&c.get("cni:a:eth0").await.unwrap(), "tap_name");
    env.ns_cmd(&["tc", "qdisc", "del", "dev", &host_end, "clsact"]);
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert!(chk.ok, "{chk:?}");
    assert!(
        env.ns_cmd(&["tc", "filter", "show", "dev", &host_end, "ingress"])
            .contains("bpf")
    );

    // Error shapes.
    let bad = cni(&env, &[("CNI_COMMAND", "BOGUS")], b"{}");
    assert_eq!(bad.code(), 4, "{bad:?}");
    let bad = cni(
        &env,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "x"),
            ("CNI_NETNS", &a.path()),
            ("CNI_PATH", "/x"),
        ],
        cf.to_string().as_bytes(),
    );
    assert_eq!(bad.code(), 4, "{bad:?}");
    assert!(bad.json["msg"].as_str().unwrap().contains("CNI_IFNAME"));
    let unknown = conf(&env, "1.0.0", json!({"bridge": "br0"}));
    let bad = verb(&env, "ADD", "x", Some(&a), &unknown);
    assert_eq!(bad.code(), 2, "{bad:?}");
    assert!(bad.json["msg"].as_str().unwrap().contains("'bridge'"));
    let bad = cni(
        &env,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "x"),
            ("CNI_NETNS", &a.path()),
            ("CNI_IFNAME", "eth1"),
            ("CNI_PATH", "/x"),
        ],
        b"not json",
    );
    assert_eq!(bad.code(), 6, "{bad:?}");
    let bad = verb(&env, "ADD", "x", Some(&a), &conf(&env, "9.9.9", json!({})));
    assert_eq!(bad.code(), 1, "{bad:?}");
    let no_ns = cni(
        &env,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "x"),
            ("CNI_NETNS", "/run/netns/does-not-exist"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/x"),
        ],
        cf.to_string().as_bytes(),
    );
    assert_eq!(no_ns.code(), 4, "{no_ns:?}");
    // The node's own namespace is refused by the agent itself.
    let own = cni(
        &env,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "own"),
            ("CNI_NETNS", &format!("/run/netns/{}", env.ns)),
            ("CNI_IFNAME", "evil0"),
            ("CNI_PATH", "/x"),
        ],
        cf.to_string().as_bytes(),
    );
    assert_eq!(own.code(), 7, "{own:?}");
    assert!(
        own.json["msg"].as_str().unwrap().contains("netns_fd"),
        "{own:?}"
    );
    assert_eq!(c.list().await.len(), 1, "bad input changed nothing");

    // GC: B and another network's attachment and a VMM network exist; only
    // B (this network, not valid) goes.
    let b = Ctr::new("b");
    add_ok(&env, "b", &b, &cf);
    let o = Ctr::new("o");
    let other = json!({"cniVersion": "1.0.0", "name": "other", "type": "cube-cni",
        "dbusAddress": env.address});
    add_ok(&env, "o", &o, &other);
    c.ensure("vm-1", opts(vec![])).await.unwrap();
    let gc_conf = conf(
        &env,
        "1.1.0",
        json!({"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}),
    );
    let gc = cni(
        &env,
        &[("CNI_COMMAND", "GC"), ("CNI_PATH", "/x")],
        gc_conf.to_string().as_bytes(),
    );
    assert!(gc.ok, "{gc:?}");
    let mut ids: Vec<String> = c.list().await.iter().map(|d| s(d, "sandbox_id")).collect();
    ids.sort();
    assert_eq!(ids, vec!["cni:a:eth0", "cni:o:eth0", "vm-1"]);
    // GC has no namespace to work in: B's pair goes with the batched
    // deletion of retired veths.
    wait_retired_gone(&env);
    assert!(
        b.ip_json(&["link", "show", "eth0"]).is_null(),
        "B's veth gone"
    );
    let gc_bad = cni(
        &env,
        &[("CNI_COMMAND", "GC"), ("CNI_PATH", "/x")],
        conf(&env, "1.1.0", json!({})).to_string().as_bytes(),
    );
    assert_eq!(gc_bad.code(), 7, "no list is not an empty list: {gc_bad:?}");
    assert_eq!(c.list().await.len(), 3);

    // DEL three times; then the veth is gone on both sides.
    for _ in 0..3 {
        let del = verb(&env, "DEL", "a", Some(&a), &cf);
        assert!(del.ok, "{del:?}");
    }
    assert!(c.get("cni:a:eth0").await.is_err());
    assert!(a.ip_json(&["link", "show", "eth0"]).is_null());
    // A runtime retrying ADD right after a DEL finds CNI_IFNAME free
    // (the old peer stepped aside; the pair is deleted in the background).
    let r = verb(&env, "ADD", "a", Some(&a), &cf);
    assert!(r.ok, "ADD right after DEL: {r:?}");
    let del = verb(&env, "DEL", "a", Some(&a), &cf);
    assert!(del.ok, "{del:?}");
    // DEL after the namespace vanished (the pair went with it).
    drop(o);
    let del = verb(&env, "DEL", "o", None, &other);
    assert!(del.ok, "{del:?}");
    assert!(env.cni_veths().is_empty(), "{:?}", env.cni_veths());
    c.release("vm-1").await.unwrap();
    assert!(c.list().await.is_empty());
    wait_retired_gone(&env);
    assert!(
        a.ip_json(&["-o", "link"])
            .as_array()
            .is_some_and(|l| l.len() == 1),
        "only lo left in the container's namespace: {}",
        a.ip_json(&["link"])
    );

    // STATUS: ready with a healthy agent; 50 and 11 when it is down.
    let st = cni(
        &env,
        &[("CNI_COMMAND", "STATUS")],
        cf.to_string().as_bytes(),
    );
    assert!(st.ok && st.json.is_null(), "{st:?}");
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
    env.kill_agent();
    let st = cni(
        &env,
        &[("CNI_COMMAND", "STATUS")],
        cf.to_string().as_bytes(),
    );
    assert_eq!(st.code(), 50, "{st:?}");
    let c2 = Ctr::new("down");
    let add = verb(&env, "ADD", "down", Some(&c2), &cf);
    assert_eq!(add.code(), 11, "{add:?}");
    let del = verb(&env, "DEL", "down", Some(&c2), &cf);
    assert_eq!(del.code(), 11, "agent down: DEL must be retried: {del:?}");
    env.start_agent();
    let del = verb(&env, "DEL", "down", Some(&c2), &cf);
    assert!(del.ok, "{del:?}");
    drop(world);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_mapping_and_traffic_across_kill_9() {
    require_root!();
    let (mut env, world) = world::node(&[]);
    let c = env.client().await;
    let echo = world.udp_echo(0);
    let ctr = Ctr::new("pm");
    // CRI's spelling of port mappings (go-cni's struct has no JSON tags).
    let cf = conf(
        &env,
        "1.0.0",
        json!({"runtimeConfig": {"portMappings": [
            {"HostPort": 20080, "ContainerPort": 80, "Protocol": "tcp", "HostIP": ""}]}}),
    );
    add_ok(&env, "pm", &ctr, &cf);
    let net = c.get("cni:pm:eth0").await.unwrap();
    assert_eq!(
        common::mappings(&net),
        vec![("tcp".to_string(), 80, 20080, "0.0.0.0".to_string())]
    );
    let srv = Server::tcp(
        &ctr.name,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 80),
        b"ctr:",
    );
    let got = world
        .tcp_connect(World::node_addr(20080), b"in", Duration::from_secs(3))
        .unwrap();
    assert_eq!(got, b"ctr:in");

    // A steady flow from the container to the world across kill -9 and a
    // restart of the agent: nothing lost.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, lost) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flow = {
        let (stop, sent, lost, ns) = (stop.clone(), sent.clone(), lost.clone(), ctr.name.clone());
        std::thread::spawn(move || {
            let sock = in_netns(&ns, || std::net::UdpSocket::bind("0.0.0.0:0").unwrap());
            sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut buf = [0u8; 64];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let msg = format!("{n}");
                sock.send_to(msg.as_bytes(), echo).unwrap();
                sent.fetch_add(1, Ordering::Relaxed);
                let deadline = Instant::now() + Duration::from_secs(1);
                loop {
                    match sock.recv(&mut buf) {
                        Ok(k) if &buf[..k] == format!("world:{n}").as_bytes() => break,
                        Ok(_) if Instant::now() < deadline => continue,
                        _ => {
                            lost.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    env.kill_agent();
    std::thread::sleep(Duration::from_millis(700));
    env.start_agent();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    flow.join().unwrap();
    let (sent, lost) = (sent.load(Ordering::Relaxed), lost.load(Ordering::Relaxed));
    eprintln!("container -> world across kill -9: sent {sent}, lost {lost}");
    assert!(sent > 50, "the flow ran: {sent}");
    assert_eq!(lost, 0, "datagrams lost across kill -9 ({sent} sent)");

    // The restarted agent adopted the veth network: Health true, CHECK ok,
    // the mapping still works, DEL cleans up.
    let c = env.client().await;
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
    let veths = checks.iter().find(|c| c.0 == "sandbox_links").unwrap();
    assert!(veths.2.contains("1 veth"), "{veths:?}");
    let chk = verb(&env, "CHECK", "pm", Some(&ctr), &cf);
    assert!(chk.ok, "{chk:?}");
    let got = world
        .tcp_connect(World::node_addr(20080), b"again", Duration::from_secs(3))
        .unwrap();
    assert_eq!(got, b"ctr:again");
    // OpenTap on a veth network is refused, naming why.
    let e = c.open_tap("cni:pm:eth0").await.unwrap_err();
    assert!(e.message.contains("veth"), "{e:?}");

    // The veth's filter removed while the agent is down: recovery finds it
    // missing in the kernel (not in its pinned record) and attaches it
    // again, so the container's replies are translated once more.
    let host_end = s(&c.get("cni:pm:eth0").await.unwrap(), "tap_name");
    drop(c);
    env.kill_agent();
    env.ns_cmd(&["tc", "qdisc", "del", "dev", &host_end, "clsact"]);
    env.start_agent();
    let c = env.client().await;
    assert!(
        env.log().contains("no clsact qdisc; attached again"),
        "recovery did not report the veth's missing filter"
    );
    assert!(
        env.ns_cmd(&["tc", "filter", "show", "dev", &host_end, "ingress"])
            .contains("bpf")
    );
    let got = world
        .tcp_connect(
            World::node_addr(20080),
            b"refiltered",
            Duration::from_secs(3),
        )
        .unwrap();
    assert_eq!(got, b"ctr:refiltered");

    // The container's namespace vanishes without a DEL: the veth went
    // with it, and Health says so (`sandbox_links`, naming the network)
    // until Reconcile records it gone; then Health is true again and
    // `veths` lists the network waiting for its DEL, which frees it.
    // (A socket keeps its namespace alive: the listener goes first.)
    drop(srv);
    drop(ctr);
    // The kernel destroys a deleted namespace's devices from a work queue.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !env.cni_veths().is_empty() {
        assert!(Instant::now() < deadline, "the veth outlived its namespace");
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let (healthy, checks) = c.health().await;
        let links = checks.iter().find(|c| c.0 == "sandbox_links").unwrap();
        if !healthy && !links.1 && links.2.contains("cni:pm:eth0: veth ") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a veth gone without DEL is reported: {checks:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = c.reconcile("cni:pm:eth0").await.unwrap();
    let errors: Vec<String> = r["errors"].try_clone().unwrap().try_into().unwrap();
    assert!(errors.iter().any(|e| e.contains("is gone")), "{errors:?}");
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
    let veths = checks.iter().find(|c| c.0 == "sandbox_links").unwrap();
    assert!(veths.2.contains("cni:pm:eth0"), "{veths:?}");
    let del = verb(&env, "DEL", "pm", None, &cf);
    assert!(del.ok, "{del:?}");
    assert!(c.list().await.is_empty());
    assert!(env.cni_veths().is_empty());
    wait_retired_gone(&env);
}

/// Kata's tcfilter model: inside the container's namespace a TAP plus two
/// tc mirred redirects (eth0 <-> tap0_kata), and a guest on that TAP with
/// eth0's address and MAC. The agent's veth carries it unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kata_tcfilter_on_top_of_the_veth() {
    require_root!();
    let (env, world) = world::node(&[]);
    let echo = world.udp_echo(0);
    let ctr = Ctr::new("kata");
    add_ok(&env, "kata", &ctr, &conf(&env, "1.0.0", json!({})));
    let tap = in_netns(&ctr.name, || {
        cube_network_agent::tap::Tap::create("tap0_kata").unwrap()
    });
    for cmd in [
        "ip link set tap0_kata up",
        "tc qdisc add dev eth0 ingress",
        "tc filter add dev eth0 parent ffff: protocol all u32 match u8 0 0 action mirred egress redirect dev tap0_kata",
        "tc qdisc add dev tap0_kata ingress",
        "tc filter add dev tap0_kata parent ffff: protocol all u32 match u8 0 0 action mirred egress redirect dev eth0",
    ] {
        let out = Command::new("ip")
            .args(["netns", "exec", &ctr.name, "sh", "-c", cmd])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let fd = tap.dup().unwrap();
    drop(tap);
    let guest = common::guest::Guest::start_default(fd);
    guest
        .ping(GATEWAY.parse().unwrap(), Duration::from_secs(3))
        .expect("guest -> gateway through mirred + veth");
    let got = guest
        .udp_send_recv(echo, b"kata", Duration::from_secs(3))
        .expect("guest -> world");
    assert_eq!(got, b"world:kata");
    let del = verb(
        &env,
        "DEL",
        "kata",
        Some(&ctr),
        &conf(&env, "1.0.0", json!({})),
    );
    assert!(del.ok, "{del:?}");
}

fn cnirun() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = root.join("target/cnirun/cnirun");
    let st = Command::new(root.join("tests/cni/build-cnirun.sh"))
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success(), "building the libcni client failed");
    out
}

/// A plugin dir: cube-cni plus the named stock plugins.
fn bin_dir(dir: &Path, stock: &[&str]) -> PathBuf {
    let bin = dir.join("cnibin");
    std::fs::create_dir_all(&bin).unwrap();
    let link = |target: &Path, name: &str| {
        let _ = std::fs::remove_file(bin.join(name));
        std::os::unix::fs::symlink(target, bin.join(name)).unwrap();
    };
    link(Path::new(env!("CARGO_BIN_EXE_cube-cni")), "cube-cni");
    for p in stock {
        link(&Path::new("/usr/lib/cni").join(p), p);
    }
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libcni_client_with_a_chained_stock_plugin() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cnirun = cnirun();
    let bin = bin_dir(&env.dir, &["tuning"]);
    let confdir = env.dir.join("netd");
    std::fs::create_dir_all(&confdir).unwrap();
    let list = json!({
        "cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"], "name": "cube",
        "plugins": [
            {"type": "cube-cni", "dbusAddress": env.address,
             "capabilities": {"portMappings": true, "bandwidth": true}},
            {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.rp_filter": "0"}}
        ]
    });
    std::fs::write(confdir.join("10-cube.conflist"), list.to_string()).unwrap();
    let run_if = |verb: &str, cid: &str, ctr: &Ctr, cap: &str, ifname: &str| {
        let out = Command::new("ip")
            .args(["netns", "exec", &env.ns])
            .arg(&cnirun)
            .args([verb, "cube", &ctr.path()])
            .env("NETCONFPATH", &confdir)
            .env("CNI_PATH", &bin)
            .env("CNI_CACHE_DIR", env.dir.join("cnicache"))
            .env("CNI_CONTAINERID", cid)
            .env("CNI_IFNAME", ifname)
            .env("CAP_ARGS", cap)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let run = |verb: &str, cid: &str, ctr: &Ctr, cap: &str| run_if(verb, cid, ctr, cap, "eth0");
    let ctr = Ctr::new("lib");
    a_sysctl_default(&ctr);
    // libcni passes the capability args the plugin declares: port mappings
    // and the bandwidth capability (rates in bits/s, bursts in bits).
    let cap = r#"{"portMappings":[{"hostPort":20081,"containerPort":80,"protocol":"tcp"}],
        "bandwidth":{"ingressRate":20000000,"ingressBurst":1048576,"egressRate":30000000,"egressBurst":2097152}}"#;
    let (ok, out, err) = run("add", "lib1", &ctr, cap);
    assert!(ok, "libcni ADD: {out} {err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["cniVersion"], "1.0.0");
    assert_eq!(r["ips"][1]["address"], GUEST, "{r}");
    assert_eq!(
        ctr.sh("cat /proc/sys/net/ipv4/conf/eth0/rp_filter").trim(),
        "0",
        "tuning ran after cube-cni on its prevResult"
    );
    let net = c.get("cni:lib1:eth0").await.unwrap();
    assert_eq!(common::mappings(&net)[0].2, 20081);
    let num = |k: &str| u64::try_from(net[k].try_clone().unwrap()).unwrap();
    assert_eq!(
        [
            num("ingress_bps"),
            num("ingress_burst"),
            num("egress_bps"),
            num("egress_burst")
        ],
        [20_000_000, 131_072, 30_000_000, 262_144]
    );
    let (ok, out, err) = run("check", "lib1", &ctr, cap);
    assert!(
        ok,
        "libcni CHECK (cached result as prevResult): {out} {err}"
    );
    // A second attachment in the same namespace, and an ifname the kernel
    // would expand, are refused with their codes; lib1 keeps working.
    let (ok, _, err) = run_if("add", "lib1", &ctr, "{}", "eth1");
    assert!(!ok && err.contains("code=108"), "second attachment: {err}");
    let (ok, _, err) = run_if("add", "lib1", &ctr, "{}", "eth%d");
    assert!(!ok && err.contains("code=4"), "eth%d: {err}");
    assert_eq!(c.list().await.len(), 1);
    let (ok, out, err) = run("check", "lib1", &ctr, cap);
    assert!(ok, "lib1 after the refused ADDs: {out} {err}");
    for _ in 0..2 {
        let (ok, out, err) = run("del", "lib1", &ctr, cap);
        assert!(ok, "libcni DEL: {out} {err}");
    }
    assert!(c.list().await.is_empty());

    // What containerd's CRI takes as the pod IP (go-cni's attribution of
    // the result): the node-unique sandbox address.
    let ctr2 = Ctr::new("lib2");
    let (ok, out, err) = run("podip", "lib2", &ctr2, cap);
    assert!(ok, "go-cni Setup: {out} {err}");
    let net = c.get("cni:lib2:eth0").await.unwrap();
    assert_eq!(
        out.lines().next().unwrap_or(""),
        s(&net, "sandbox_ip"),
        "{out}"
    );
    // And the first IPv6 (kubelet's pod IP of that family, from CRI's
    // additional IPs) the node-unique sandbox IPv6 address.
    let first6 = out
        .lines()
        .find_map(|l| l.strip_prefix("additional="))
        .and_then(|l| l.split(',').find(|a| a.contains(':')));
    assert_eq!(first6, Some(s(&net, "sandbox_ipv6").as_str()), "{out}");
    assert_eq!(
        common::mappings(&net)[0].2,
        20081,
        "CRI-style port mappings arrive"
    );
    let (ok, out, err) = run("del", "lib2", &ctr2, cap);
    assert!(ok, "{out} {err}");
    assert!(c.list().await.is_empty());
    drop(world);
}

/// Kubernetes through containerd's CRI (issue 51): the bandwidth
/// annotations arrive as go-cni's untagged struct (capitalised keys) with
/// 2^32-1 for an unset burst; the pod starts with the default burst (not
/// a 512 MiB one), and a DEL whose configuration cannot be parsed still
/// releases the network it names (a failing DEL wedges the pod forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cri_bandwidth_keys_and_a_del_that_never_wedges() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let ctr = Ctr::new("k8s");
    let cri = conf(
        &env,
        "1.0.0",
        json!({"runtimeConfig": {"bandwidth": {"IngressRate": 10_000_000u64,
            "IngressBurst": 4_294_967_295u64, "EgressRate": 10_000_000u64,
            "EgressBurst": 4_294_967_295u64}}}),
    );
    add_ok(&env, "k8s1", &ctr, &cri);
    let net = c.get("cni:k8s1:eth0").await.unwrap();
    let num = |k: &str| u64::try_from(net[k].try_clone().unwrap()).unwrap();
    assert_eq!(
        [
            num("ingress_bps"),
            num("ingress_burst"),
            num("egress_bps"),
            num("egress_burst")
        ],
        [10_000_000, 65_536, 10_000_000, 65_536],
        "an unset burst is the default burst (64 KiB), not 512 MiB"
    );
    // A known key with a value the agent cannot honour: ADD refuses it by
    // name and changes nothing.
    let ctr2 = Ctr::new("k8s2");
    let bad = conf(
        &env,
        "1.0.0",
        json!({"runtimeConfig": {"bandwidth": {"EgressRate": "10M"}}}),
    );
    let out = verb(&env, "ADD", "k8s2", Some(&ctr2), &bad);
    assert!(!out.ok, "{out:?}");
    assert_eq!(out.json["code"], 7, "{out:?}");
    assert!(
        out.json["msg"]
            .as_str()
            .unwrap_or("")
            .contains("runtimeConfig.bandwidth.EgressRate"),
        "{out:?}"
    );
    assert_eq!(c.list().await.len(), 1, "the refused ADD made nothing");
    // DEL with a configuration ADD would refuse (bad values, an unknown
    // key, a version this plugin does not speak) releases all the same.
    let garbage = conf(
        &env,
        "9.9.9",
        json!({"runtimeConfig": {"bandwidth": {"EgressRate": "x"},
            "portMappings": "nope"}, "bogus": true, "mtu": "big"}),
    );
    let out = verb(&env, "DEL", "k8s1", Some(&ctr), &garbage);
    assert!(out.ok, "DEL with a garbage configuration: {out:?}");
    assert!(c.list().await.is_empty(), "DEL released the network");
    // Again (the network is gone): DEL is repeatable.
    let out = verb(&env, "DEL", "k8s1", Some(&ctr), &garbage);
    assert!(out.ok, "repeated DEL: {out:?}");
    drop(world);
}

fn a_sysctl_default(ctr: &Ctr) {
    // A new namespace starts with the host's default rp_filter; make it
    // non-zero so that tuning's 0 is visible.
    ctr.sh("echo 2 > /proc/sys/net/ipv4/conf/default/rp_filter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_ctr_run_with_cube_cni() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let bin = bin_dir(&env.dir, &["loopback"]);
    let confdir = env.dir.join("netd");
    std::fs::create_dir_all(&confdir).unwrap();
    // ctr has no port flags: a static mapping in the plugin's config.
    let list = json!({
        "cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"], "name": "cube",
        "plugins": [{"type": "cube-cni", "dbusAddress": env.address,
            "capabilities": {"portMappings": true},
            "runtimeConfig": {"portMappings": [{"hostPort": 20082, "containerPort": 80, "protocol": "tcp"}]}}]
    });
    std::fs::write(confdir.join("10-cube.conflist"), list.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cni/ctr-run.sh");
    let ctr = |mode: &str, arg: &str| {
        Command::new(&script)
            .args([mode, arg])
            .env("NODE_NS", &env.ns)
            .env("CONF_DIR", &confdir)
            .env("BIN_DIR", &bin)
            .output()
            .unwrap()
    };
    // One-shot: the container sees its address, reaches the gateway and
    // the world (SNAT); --rm releases the network.
    let out = ctr(
        "run",
        "ip -o -4 addr show eth0; ping -c1 -W2 169.254.68.5 && ping -c1 -W2 198.51.100.2 && echo REACHED",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ctr run: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(GUEST), "{text}");
    assert!(text.contains("REACHED"), "{text}");
    assert!(c.list().await.is_empty(), "--rm ran DEL");

    // Long-running: the port mapping reaches a listener inside it.
    let out = ctr("start", "while true; do echo pong | nc -l -p 80; done");
    let vars = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "ctr start: {vars} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state = vars
        .lines()
        .find_map(|l| l.strip_prefix("CTR_RUN_STATE="))
        .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_owned())
        .expect("CTR_RUN_STATE");
    let listed = c.list().await;
    assert_eq!(listed.len(), 1);
    assert_eq!(s(&listed[0], "attach"), "veth");
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        match world.tcp_connect(World::node_addr(20082), b"", Duration::from_secs(2)) {
            Ok(g) if !g.is_empty() => break g,
            r if Instant::now() > deadline => panic!("port mapping into the container: {r:?}"),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    assert_eq!(got, b"pong\n");
    let out = ctr("stop", &state);
    assert!(
        out.status.success(),
        "ctr stop: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(c.list().await.is_empty(), "the task's end ran DEL");
    assert!(env.cni_veths().is_empty());
}

/// One verb with an explicit interface name and namespace path.
fn verb_at(env: &Env, command: &str, cid: &str, netns: &str, ifname: &str, conf: &Value) -> Out {
    cni(
        env,
        &[
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", cid),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", ifname),
            ("CNI_PATH", "/opt/cni/bin"),
        ],
        conf.to_string().as_bytes(),
    )
}

/// Attachments are identified injectively and every verb acts only on the
/// attachment whose recorded container id, ifname and namespace match
/// (issue 16): ids that collided before, a VMM network under a CNI-looking
/// id, DEL and CHECK pointed at another container's namespace, a second
/// attachment in one namespace, and an ifname the kernel would expand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attachments_are_injective_and_verbs_act_only_on_their_own() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cf = conf(&env, "1.0.0", json!({}));
    let ids = |c: &common::Client| {
        let c = c.clone();
        async move {
            let mut v: Vec<String> = c.list().await.iter().map(|d| s(d, "sandbox_id")).collect();
            v.sort();
            v
        }
    };

    // (my-app, eth0) and (my, app-eth0) were both "cni-my-app-eth0".
    let x = Ctr::new("x");
    let y = Ctr::new("y");
    let out = verb_at(&env, "ADD", "my-app", &x.path(), "eth0", &cf);
    assert!(out.ok, "{out:?}");
    let out = verb_at(&env, "ADD", "my", &y.path(), "app-eth0", &cf);
    assert!(out.ok, "two distinct attachments: {out:?}");
    assert_eq!(ids(&c).await, vec!["cni:my-app:eth0", "cni:my:app-eth0"]);
    let out = verb_at(&env, "DEL", "my", &y.path(), "app-eth0", &cf);
    assert!(out.ok, "{out:?}");
    assert_eq!(ids(&c).await, vec!["cni:my-app:eth0"]);
    let chk = verb_at(&env, "CHECK", "my-app", &x.path(), "eth0", &cf);
    assert!(chk.ok, "the other attachment is untouched: {chk:?}");

    // A VMM's TAP network under the old scheme's id of (vmm, 1): DEL of
    // that attachment leaves it alone; a TAP network cannot take a cni: id.
    c.ensure("cni-vmm-1", opts(vec![])).await.unwrap();
    let out = verb_at(&env, "DEL", "vmm", &y.path(), "1", &cf);
    assert!(out.ok, "nothing of (vmm, 1) exists: {out:?}");
    assert!(c.get("cni-vmm-1").await.is_ok(), "the TAP network survives");
    let e = c.ensure("cni:vmm:1", opts(vec![])).await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.InvalidArgument");
    assert!(e.message.contains("cni:"), "{}", e.message);

    // Containers a and b, both eth0. DEL and CHECK of a pointed at b's
    // namespace change nothing and leave b's interface up.
    let a = Ctr::new("a");
    let b = Ctr::new("b");
    add_ok(&env, "a", &a, &cf);
    add_ok(&env, "b", &b, &cf);
    let before = ids(&c).await;
    let del = verb_at(&env, "DEL", "a", &b.path(), "eth0", &cf);
    assert_eq!(del.code(), 108, "DEL into another namespace: {del:?}");
    assert!(
        del.json["msg"].as_str().unwrap().contains("netns_fd"),
        "{del:?}"
    );
    assert_eq!(ids(&c).await, before, "nothing released");
    let (addrs, gw, up) = inside(&b);
    assert!(up && gw.as_deref() == Some(GATEWAY), "b untouched");
    assert_eq!(addrs, vec![GUEST.to_string()]);
    let chk = verb_at(&env, "CHECK", "a", &b.path(), "eth0", &cf);
    assert_eq!(chk.code(), 105, "{chk:?}");
    assert!(
        chk.json["msg"].as_str().unwrap().contains("namespace"),
        "{chk:?}"
    );
    // ADD of a's id into b's namespace (another eth1) is refused too.
    let add = verb_at(&env, "ADD", "a", &b.path(), "eth1", &cf);
    assert!(!add.ok, "{add:?}");

    // A second attachment in a's namespace would take a's address and
    // default route: refused, and a keeps working.
    let second = verb_at(&env, "ADD", "a", &a.path(), "eth1", &cf);
    assert_eq!(second.code(), 108, "{second:?}");
    assert!(
        second.json["msg"]
            .as_str()
            .unwrap()
            .contains("already has an attachment"),
        "{second:?}"
    );
    let second = verb_at(&env, "ADD", "other", &a.path(), "eth1", &cf);
    assert_eq!(
        second.code(),
        108,
        "another container id, same namespace: {second:?}"
    );
    assert!(
        a.ip_json(&["link", "show", "eth1"]).is_null(),
        "no eth1 left"
    );
    assert_eq!(ids(&c).await, before);
    let chk = verb(&env, "CHECK", "a", Some(&a), &cf);
    assert!(chk.ok, "{chk:?}");
    let echo = world.udp_echo(0);
    assert_eq!(
        world::udp_exchange_in(&a.name, echo, b"a", Duration::from_secs(3)).unwrap(),
        b"world:a"
    );

    // The kernel would expand "%d": refused before anything is made.
    let pct = verb_at(&env, "ADD", "p", &y.path(), "eth%d", &cf);
    assert_eq!(pct.code(), 4, "{pct:?}");
    assert!(pct.json["msg"].as_str().unwrap().contains('%'), "{pct:?}");
    assert_eq!(ids(&c).await, before);
    let bad = verb_at(&env, "ADD", "a:b", &y.path(), "eth0", &cf);
    assert_eq!(bad.code(), 4, "container ids have no ':': {bad:?}");

    // The namespace of a released attachment is free again.
    let del = verb(&env, "DEL", "a", Some(&a), &cf);
    assert!(del.ok, "{del:?}");
    let again = verb_at(&env, "ADD", "a2", &a.path(), "eth1", &cf);
    assert!(again.ok, "{again:?}");
    for (cid, ctr, ifname) in [
        ("a2", &a, "eth1"),
        ("b", &b, "eth0"),
        ("my-app", &x, "eth0"),
    ] {
        let del = verb_at(&env, "DEL", cid, &ctr.path(), ifname, &cf);
        assert!(del.ok, "{del:?}");
    }
    assert_eq!(ids(&c).await, vec!["cni-vmm-1"]);
    drop(world);
}

/// An error about the environment (here a missing `CNI_PATH`) is answered
/// in the configuration's own `cniVersion`, as every other error is: the
/// plugin reads stdin before it judges the environment. No agent needed.
/// A container gone without a DEL (its runtime removed it while the
/// agent was down and never retries: podman): the agent releases the
/// network once the container's namespace is gone, logged with the reason
/// (its periodic check here; tests/podman.rs has the start-up one), and
/// never one whose namespace lives on, though its interface was deleted
/// (not across a restart either). A late DEL and GC still succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn networks_of_gone_namespaces_are_released_live_ones_never() {
    require_root!();
    let mut env = Env::new(&[]);
    let c = env.client().await;
    let conf1 = conf(&env, "1.0.0", json!({}));
    let gone = Ctr::new("gone");
    let alive = Ctr::new("alive");
    add_ok(&env, "gone", &gone, &conf1);
    add_ok(&env, "alive", &alive, &conf1);
    // The namespace lives on; its interface (the veth) does not.
    assert!(
        Command::new("ip")
            .args(["-n", &alive.name, "link", "del", "eth0"])
            .status()
            .unwrap()
            .success()
    );
    drop(gone);
    let ids = |nets: Vec<common::Dict>| nets.iter().map(|n| s(n, "sandbox_id")).collect::<Vec<_>>();
    let deadline = Instant::now() + Duration::from_secs(40);
    while ids(c.list().await).len() > 1 {
        assert!(
            Instant::now() < deadline,
            "the gone namespace's network was not released"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(ids(c.list().await), ["cni:alive:eth0"]);
    let log = env.log();
    let line = log
        .lines()
        .find(|l| l.contains("its container's network namespace is gone"))
        .unwrap_or_else(|| panic!("no release logged:\n{log}"));
    assert!(
        line.contains("cni:gone:eth0") && line.contains("namespace id"),
        "{line}"
    );
    // A restart checks at once: the living namespace keeps its network.
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(ids(c.list().await), ["cni:alive:eth0"]);
    // Late verbs still succeed.
    let out = verb(&env, "DEL", "gone", None, &conf1);
    assert!(out.ok, "late DEL: {out:?}");
    let gc = conf(
        &env,
        "1.1.0",
        json!({"cni.dev/valid-attachments": [{"containerID": "alive", "ifname": "eth0"}]}),
    );
    let out = verb(&env, "GC", "", None, &gc);
    assert!(out.ok, "GC: {out:?}");
    let out = verb(&env, "DEL", "alive", Some(&alive), &conf1);
    assert!(out.ok, "DEL: {out:?}");
    assert!(c.list().await.is_empty());
}

#[test]
fn environment_errors_answer_in_the_configs_version() {
    for version in ["1.0.0", "0.4.0", "1.1.0"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cube-cni"))
            .env_clear()
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", "c1")
            .env("CNI_NETNS", "/proc/self/ns/net")
            .env("CNI_IFNAME", "eth0")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let conf = json!({"cniVersion": version, "name": "cube", "type": "cube-cni"});
        std::io::Write::write_all(
            &mut child.stdin.take().unwrap(),
            conf.to_string().as_bytes(),
        )
        .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success());
        let err: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(err["code"], 4, "{err}");
        assert!(err["msg"].as_str().unwrap().contains("CNI_PATH"), "{err}");
        assert_eq!(err["cniVersion"], version, "{err}");
    }
}
