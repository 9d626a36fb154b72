//! End-to-end tests: the real agent binary in its own network namespace,
//! driven over a real (private) dbus-daemon. Root only.

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{Env, mappings, opts, ports, s, tap_info, u};

/// Polls until link `name` is gone (true) or 5 s passed (false).
fn wait_gone(env: &Env, name: &str) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if !env.links().contains_key(name) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}
use zbus::zvariant::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_ensure_open_tap_release() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    let net = c
        .ensure(
            "sbx-1",
            opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
        )
        .await
        .unwrap();
    let tap = s(&net, "tap_name");
    let ip = s(&net, "sandbox_ip");
    assert!(ip.starts_with("192.168."), "{ip}");
    assert_eq!(s(&net, "guest_ip"), "169.254.68.6/30");
    assert_eq!(s(&net, "gateway_ip"), "169.254.68.5");
    assert_eq!(s(&net, "guest_mac"), "20:90:6f:fc:fc:fc");
    assert_eq!(s(&net, "gateway_mac"), "20:90:6f:cf:cf:cf");
    assert_eq!(u(&net, "mtu"), 1300);
    let m = mappings(&net);
    assert_eq!(m.len(), 1);
    assert!((20000..=29999).contains(&m[0].2), "{m:?}");

    // The kernel agrees: TAP up with the MTU, neighbour entry permanent.
    let links = env.links();
    let link = &links[&tap];
    assert_eq!((link.kind.as_str(), link.up, link.mtu), ("tun", true, 1300));
    assert!(
        env.neighbours()
            .contains(&(ip.clone(), "20:90:6f:fc:fc:fc".to_string()))
    );
    assert!(
        env.ns_cmd(&["ip", "route", "show", "192.168.0.0/18"])
            .contains("dev cube-dev")
    );

    // GetNetwork adds the traffic counters to what EnsureNetwork answered.
    let mut got = c.get("sbx-1").await.unwrap();
    assert!(got.remove("traffic").is_some(), "{got:?}");
    assert_eq!(got, net);
    assert_eq!(c.list().await, vec![net.clone()]);

    // OpenTap: a TAP fd of the right device with a 12-byte vnet header,
    // a fresh duplicate each call.
    let fd1 = c.open_tap("sbx-1").await.unwrap();
    let fd2 = c.open_tap("sbx-1").await.unwrap();
    let info = tap_info(&fd1);
    assert_eq!(info.name, tap);
    assert!(info.is_tap_with_vnet_hdr(), "{info:?}");
    assert_eq!(info.vnet_hdr_len, 12);
    assert_eq!(tap_info(&fd2).name, tap);
    use std::os::fd::AsRawFd;
    assert_ne!(fd1.as_raw_fd(), fd2.as_raw_fd());

    assert!(c.release("sbx-1").await.unwrap());
    // The TAP was handed out (OpenTap; fd1 and fd2 still refer to it): it
    // never goes back to the pool, it is deleted off the reply path (in
    // the retire group at once, gone with the next deletion batch, within
    // ~1 s).
    assert!(
        env.links().get(&tap).is_none_or(|l| l.retiring),
        "released TAP {tap} is retiring at once"
    );
    assert!(
        wait_gone(&env, &tap),
        "a handed-out TAP ({tap}) is deleted, not pooled"
    );
    // The holder's fds are detached from any device: nothing to read, and
    // a write goes nowhere (the kernel says the fd has no device).
    let mut buf = [0u8; 2048];
    // SAFETY: read(2) into a live buffer of the size passed.
    let n = unsafe { libc::read(fd1.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(
        (n, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EBADFD)),
        "read on a deleted TAP's fd"
    );
    // A TAP nobody opened is not pooled either: frames queued for its
    // sandbox and its counters would reach the next owner.
    c.ensure("sbx-2", opts(vec![])).await.unwrap();
    let tap2 = s(&c.get("sbx-2").await.unwrap(), "tap_name");
    assert!(c.release("sbx-2").await.unwrap());
    assert!(
        wait_gone(&env, &tap2),
        "{tap2} (never opened) is deleted, not pooled"
    );
    assert!(env.neighbours().is_empty());
    let e = c.get("sbx-1").await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.NotFound");
    assert!(e.message.contains("sbx-1"));
    assert_eq!(
        c.open_tap("sbx-1").await.unwrap_err().name,
        "org.cube.NetworkAgent.Error.NotFound"
    );
    assert!(
        !c.release("sbx-1").await.unwrap(),
        "second release reports false"
    );
    assert!(c.list().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_is_idempotent_and_converges() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    let spec = || {
        opts(vec![
            (
                "port_mappings",
                ports(&[("tcp", 80, 0, ""), ("udp", 53, 25053, "")]),
            ),
            (
                "metadata",
                Value::from(HashMap::from([("owner".to_string(), "t".to_string())])),
            ),
        ])
    };
    let a = c.ensure("sbx-c", spec()).await.unwrap();
    let b = c.ensure("sbx-c", spec()).await.unwrap();
    assert_eq!(a, b, "same request, same network");
    let tcp80 = mappings(&a)[0].2;

    // Change: keep tcp/80 (auto), drop udp/53, add tcp/443, new MTU.
    let c2 = c
        .ensure(
            "sbx-c",
            opts(vec![
                (
                    "port_mappings",
                    ports(&[("tcp", 80, 0, ""), ("tcp", 443, 0, "")]),
                ),
                ("mtu", Value::from(1400u32)),
                ("deny_out", Value::from(vec!["10.0.0.0/8".to_string()])),
            ]),
        )
        .await
        .unwrap();
    assert_eq!(s(&c2, "sandbox_ip"), s(&a, "sandbox_ip"));
    assert_eq!(s(&c2, "tap_name"), s(&a, "tap_name"));
    assert_eq!(s(&c2, "network_handle"), s(&a, "network_handle"));
    let m = mappings(&c2);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].2, tcp80, "unchanged mapping keeps its host port");
    assert_ne!(m[1].2, tcp80);
    assert_eq!(u(&c2, "mtu"), 1400);
    assert_eq!(
        env.links()[&s(&a, "tap_name")].mtu,
        1400,
        "MTU converged in the kernel"
    );

    // The dropped udp/25053 is free again for another sandbox.
    c.ensure(
        "sbx-d",
        opts(vec![("port_mappings", ports(&[("udp", 53, 25053, "")]))]),
    )
    .await
    .unwrap();
    // And tcp 443's port is not.
    let e = c
        .ensure(
            "sbx-e",
            opts(vec![("port_mappings", ports(&[("tcp", 1, m[1].2, "")]))]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.PortInUse");

    // idempotency_key: a retry of the same request returns the stored
    // network without re-applying anything.
    let k = c
        .ensure(
            "sbx-k",
            opts(vec![("idempotency_key", Value::from("req-1"))]),
        )
        .await
        .unwrap();
    let retry = c
        .ensure(
            "sbx-k",
            opts(vec![
                ("idempotency_key", Value::from("req-1")),
                ("mtu", Value::from(1500u32)),
            ]),
        )
        .await
        .unwrap();
    assert_eq!(u(&retry, "mtu"), u(&k, "mtu"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_take_the_source_spec_with_fresh_host_ports() {
    require_root!();
    let mut env = Env::new(&[]);
    let c = env.client().await;
    let golden = c
        .ensure(
            "golden",
            opts(vec![
                (
                    "port_mappings",
                    ports(&[("tcp", 80, 0, ""), ("udp", 53, 0, "")]),
                ),
                ("allow_internet_access", Value::from(false)),
                ("allow_out", Value::from(vec!["10.1.0.0/16".to_string()])),
                ("deny_out", Value::from(vec!["10.1.2.0/24".to_string()])),
                ("mtu", Value::from(1400u32)),
                (
                    "metadata",
                    Value::from(HashMap::from([("role".to_string(), "golden".to_string())])),
                ),
            ]),
        )
        .await
        .unwrap();
    // Three clones at once, each naming only its source and its metadata.
    let make = |i: usize| {
        let c = &c;
        async move {
            c.ensure(
                &format!("clone-{i}"),
                opts(vec![
                    ("clone_of", Value::from("golden")),
                    (
                        "metadata",
                        Value::from(HashMap::from([("clone".to_string(), i.to_string())])),
                    ),
                ]),
            )
            .await
            .unwrap()
        }
    };
    let clones = futures::future::join_all((0..3).map(make)).await;
    let mut host_ports: BTreeSet<(String, u16)> =
        mappings(&golden).into_iter().map(|m| (m.0, m.2)).collect();
    let mut ips = BTreeSet::from([s(&golden, "sandbox_ip")]);
    for (i, n) in clones.iter().enumerate() {
        assert_eq!(s(n, "cloned_from"), "golden");
        for k in ["allow_out", "deny_out"] {
            assert_eq!(
                Vec::<String>::try_from(n[k].try_clone().unwrap()).unwrap(),
                Vec::<String>::try_from(golden[k].try_clone().unwrap()).unwrap(),
                "{k}"
            );
        }
        assert!(!bool::try_from(n["allow_internet_access"].try_clone().unwrap()).unwrap());
        assert_eq!(u(n, "mtu"), 1400);
        assert_eq!(env.links()[&s(n, "tap_name")].mtu, 1400, "clone's TAP MTU");
        let md: HashMap<String, String> =
            HashMap::try_from(n["metadata"].try_clone().unwrap()).unwrap();
        assert_eq!(md, HashMap::from([("clone".to_string(), i.to_string())]));
        // Same mappings, each on a host port of its own.
        let (want, got) = (mappings(&golden), mappings(n));
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((&g.0, g.1), (&w.0, w.1));
            assert!(
                host_ports.insert((g.0.clone(), g.2)),
                "{} host port {} given twice",
                g.0,
                g.2
            );
        }
        assert!(ips.insert(s(n, "sandbox_ip")), "address given twice");
    }
    assert!(!golden.contains_key("cloned_from"));

    // A retried clone changes nothing (metadata aside); the source can go.
    let again = c
        .ensure("clone-0", opts(vec![("clone_of", Value::from("golden"))]))
        .await
        .unwrap();
    assert_eq!(mappings(&again), mappings(&clones[0]));
    assert_eq!(s(&again, "network_handle"), s(&clones[0], "network_handle"));
    let e = c
        .ensure("clone-0", opts(vec![("clone_of", Value::from("clone-1"))]))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.Conflict", "{e:?}");
    assert!(e.message.contains("was cloned from 'golden'"), "{e:?}");
    assert!(c.release("golden").await.unwrap());
    let e = c
        .ensure("clone-9", opts(vec![("clone_of", Value::from("golden"))]))
        .await
        .unwrap_err();
    assert!(e.message.contains("no network 'golden'"), "{e:?}");

    // Where a network was cloned from survives a crash.
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    for (i, before) in clones.iter().enumerate() {
        let n = c.get(&format!("clone-{i}")).await.unwrap();
        assert_eq!(s(&n, "cloned_from"), "golden");
        assert_eq!(mappings(&n), mappings(before));
    }
    assert_eq!(c.list().await.len(), 3);
}

/// A source whose limit came from the node's default (this node has no
/// uplink, so it could not shape a limit anyone asked for): its clones get
/// the default as every network that asks for none does, not a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_a_network_with_default_limits() {
    require_root!();
    let env = Env::new(&["--default-egress-rate", "10M"]);
    let c = env.client().await;
    let src = c.ensure("src", opts(vec![])).await.unwrap();
    let e = c
        .ensure(
            "asks",
            opts(vec![("egress_bps", Value::from(20_000_000u64))]),
        )
        .await
        .unwrap_err();
    assert!(e.message.contains("cannot enforce egress limits"), "{e:?}");
    let clone = c
        .ensure("clone", opts(vec![("clone_of", Value::from("src"))]))
        .await
        .unwrap();
    for n in [&src, &clone] {
        assert_eq!(
            u64::try_from(n["egress_bps"].try_clone().unwrap()).unwrap(),
            10_000_000
        );
    }
}

/// Everything observable that a failed call must not change.
async fn snapshot(
    env: &Env,
    c: &common::Client,
) -> (
    Vec<common::Dict>,
    BTreeSet<String>,
    BTreeSet<(String, String)>,
    u32,
) {
    let mut list = c.list().await;
    list.sort_by_key(|d| s(d, "sandbox_id"));
    (
        list,
        env.sandbox_taps(),
        env.neighbours(),
        c.property_u32("FreeAddresses").await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_ports_of_the_node_are_never_taken() {
    require_root!();
    let env = Env::new(&[
        "--datapath",
        "none",
        "--host-port-range",
        "20000-20003",
        "--allowed-host-ports",
        "22,80",
    ]);
    let c = env.client().await;
    // The node's own services, in the agent's namespace: sshd-like TCP on
    // every address, a UDP socket, a TCP service on loopback only.
    let ns = env.ns.clone();
    let _host = common::world::in_netns(&ns, || {
        (
            std::net::TcpListener::bind("0.0.0.0:22").unwrap(),
            std::net::UdpSocket::bind("0.0.0.0:20001").unwrap(),
            std::net::TcpListener::bind("127.0.0.1:20002").unwrap(),
        )
    });
    let before = snapshot(&env, &c).await;
    type Mapping<'a> = (&'a str, u16, u16, &'a str);
    let cases: Vec<(Vec<Mapping>, &str, &str)> = vec![
        (
            vec![("tcp", 80, 22, "")],
            "PortInUse",
            "port_mappings[0]: tcp host port 22 belongs to the host: a host socket is listening on 0.0.0.0:22 (uid 0",
        ),
        (
            vec![("tcp", 80, 0, ""), ("udp", 53, 20001, "")],
            "PortInUse",
            "port_mappings[1]: udp host port 20001 belongs to the host: a host socket is bound on 0.0.0.0:20001",
        ),
        (
            vec![("tcp", 80, 20002, "")],
            "PortInUse",
            "listening on 127.0.0.1:20002",
        ),
        (
            vec![("tcp", 80, 20002, "127.0.0.1")],
            "PortInUse",
            "listening on 127.0.0.1:20002",
        ),
        (
            vec![("tcp", 80, 23, "")],
            "InvalidArgument",
            "tcp host port 23 is outside host_port_range 20000-20003 and not in allowed_host_ports",
        ),
        (
            vec![("tcp", 80, 0, "10.9.9.9")],
            "InvalidArgument",
            "host_ip 10.9.9.9 is not an address of this node",
        ),
    ];
    for (m, name, fragment) in cases {
        let e = c
            .ensure("evil", opts(vec![("port_mappings", ports(&m))]))
            .await
            .unwrap_err();
        assert_eq!(
            e.name,
            format!("org.cube.NetworkAgent.Error.{name}"),
            "{m:?}: {e:?}"
        );
        assert!(e.message.contains(fragment), "{m:?}: {:?}", e.message);
        assert_eq!(snapshot(&env, &c).await, before, "{m:?} changed state");
    }
    // What the host does not use stays available: tcp 20001 (the host's
    // socket there is UDP), and 20002 on a node address other than loopback
    // (the gateway device's 192.168.0.1).
    let net = c
        .ensure(
            "fine",
            opts(vec![(
                "port_mappings",
                ports(&[("tcp", 80, 20001, ""), ("tcp", 81, 20002, "192.168.0.1")]),
            )]),
        )
        .await
        .unwrap();
    assert_eq!(
        mappings(&net)[1],
        ("tcp".into(), 81, 20002, "192.168.0.1".into())
    );
    // Automatic UDP ports skip the host's 20001.
    let net = c
        .ensure(
            "auto",
            opts(vec![(
                "port_mappings",
                ports(&[("udp", 1, 0, ""), ("udp", 2, 0, ""), ("udp", 3, 0, "")]),
            )]),
        )
        .await
        .unwrap();
    let got: Vec<u16> = mappings(&net).iter().map(|m| m.2).collect();
    assert_eq!(got, vec![20000, 20002, 20003]);
    let e = c
        .ensure(
            "more",
            opts(vec![("port_mappings", ports(&[("udp", 1, 0, "")]))]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.NodeFull", "{e:?}");
    assert!(e.message.starts_with("node full (host_ports): "), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_mistyped_calls_are_refused_before_decoding() {
    require_root!();
    let env = Env::new(&["--datapath", "none"]);
    let c = env.client().await;
    c.ensure("ok", opts(vec![])).await.unwrap();
    let before = snapshot(&env, &c).await;
    let pid = env.agent_pid();
    let h0 = common::proc_status_kib(pid, "VmHWM");
    // 100,000 port mappings (~2.4 MB on the wire; decoded, ~90 MB).
    let many: Vec<(&str, u16, u16, &str)> = (0..100_000u32)
        .map(|i| ("tcp", 1 + (i % 60_000) as u16, 0, ""))
        .collect();
    let e = c
        .ensure("big", opts(vec![("port_mappings", ports(&many))]))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.freedesktop.DBus.Error.LimitsExceeded", "{e:?}");
    assert!(
        e.message.starts_with("EnsureNetwork: the message is ")
            && e.message.contains("64 port_mappings"),
        "{e:?}"
    );
    // 100,000 metadata entries.
    let meta: HashMap<String, String> = (0..100_000)
        .map(|i| (format!("k{i}"), "v".into()))
        .collect();
    let e = c
        .ensure("big", opts(vec![("metadata", Value::from(meta))]))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.freedesktop.DBus.Error.LimitsExceeded", "{e:?}");
    let grown = common::proc_status_kib(pid, "VmHWM") - h0;
    eprintln!("peak RSS grew by {grown} KiB for two refused multi-MB calls");
    assert!(grown < 16 * 1024, "peak RSS grew by {grown} KiB");
    // Wrong signatures: the standard error, naming the expected one.
    let e = c
        .call::<_, bool>("ReleaseNetwork", &(7u32,))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.freedesktop.DBus.Error.InvalidArgs", "{e:?}");
    assert_eq!(e.message, "ReleaseNetwork takes (s), not (u)");
    let e = c
        .call::<_, common::Dict>("EnsureNetwork", &("x", 1u32))
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.freedesktop.DBus.Error.InvalidArgs", "{e:?}");
    assert_eq!(snapshot(&env, &c).await, before);
    // A valid call right after is served as usual.
    c.ensure("ok-2", opts(vec![])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_named_errors_and_changes_nothing() {
    require_root!();
    let env = Env::new(&[
        "--host-port-range",
        "20000-20002",
        "--allowed-host-ports",
        "8080",
    ]);
    let c = env.client().await;
    c.ensure(
        "holder",
        opts(vec![("port_mappings", ports(&[("tcp", 80, 8080, "")]))]),
    )
    .await
    .unwrap();
    let before = snapshot(&env, &c).await;
    let long = "x".repeat(129);
    let cases: Vec<(&str, common::Dict, &str, &str)> = vec![
        (
            "",
            opts(vec![]),
            "InvalidArgument",
            "sandbox_id: must not be empty",
        ),
        (".hidden", opts(vec![]), "InvalidArgument", "must not start"),
        ("-x", opts(vec![]), "InvalidArgument", "must not start"),
        ("a/b", opts(vec![]), "InvalidArgument", "'/'"),
        (&long, opts(vec![]), "InvalidArgument", "limit is 128"),
        (
            "ok-1",
            opts(vec![("bogus", Value::from(1u32))]),
            "InvalidArgument",
            "unknown option 'bogus'",
        ),
        (
            "ok-1",
            opts(vec![("mtu", Value::from("1400"))]),
            "InvalidArgument",
            "option mtu: expected type 'u'",
        ),
        (
            "ok-1",
            opts(vec![("mtu", Value::from(70000u32))]),
            "InvalidArgument",
            "mtu: 70000",
        ),
        (
            "ok-1",
            opts(vec![("port_mappings", Value::from(vec![1u32]))]),
            "InvalidArgument",
            "option port_mappings",
        ),
        (
            "ok-1",
            opts(vec![("port_mappings", ports(&[("sctp", 80, 0, "")]))]),
            "InvalidArgument",
            "protocol 'sctp'",
        ),
        (
            "ok-1",
            opts(vec![("port_mappings", ports(&[("tcp", 0, 0, "")]))]),
            "InvalidArgument",
            "container_port 0",
        ),
        (
            "ok-1",
            opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "1.2.3")]))]),
            "InvalidArgument",
            "host_ip '1.2.3'",
        ),
        (
            "ok-1",
            opts(vec![(
                "deny_out",
                Value::from(vec!["10.0.0.1/8".to_string()]),
            )]),
            "InvalidArgument",
            "deny_out[0]",
        ),
        (
            "ok-1",
            opts(vec![("allow_out", Value::from(vec!["nope".to_string()]))]),
            "InvalidArgument",
            "allow_out[0]: 'nope' is not an IP address, CIDR or domain pattern: a single label",
        ),
        (
            "ok-1",
            opts(vec![("allow_internet_access", Value::from("yes"))]),
            "InvalidArgument",
            "allow_internet_access",
        ),
        (
            "ok-1",
            opts(vec![("port_mappings", ports(&[("tcp", 81, 8080, "")]))]),
            "PortInUse",
            "8080",
        ),
        (
            "ok-1",
            opts(vec![(
                "port_mappings",
                ports(&[
                    ("tcp", 1, 0, ""),
                    ("tcp", 2, 0, ""),
                    ("tcp", 3, 0, ""),
                    ("tcp", 4, 0, ""),
                ]),
            )]),
            "NodeFull",
            "port_mappings[3]",
        ),
        (
            "ok-1",
            opts(vec![("clone_of", Value::from("nope"))]),
            "InvalidArgument",
            "clone_of: there is no network 'nope'",
        ),
        (
            "ok-1",
            opts(vec![("clone_of", Value::from("ok-1"))]),
            "InvalidArgument",
            "clone_of: 'ok-1' is the network being made",
        ),
        (
            "ok-1",
            opts(vec![("clone_of", Value::from("a/b"))]),
            "InvalidArgument",
            "clone_of: sandbox_id: character '/'",
        ),
        (
            "ok-1",
            opts(vec![
                ("clone_of", Value::from("holder")),
                ("allow_out", Value::from(vec!["10.0.0.0/8".to_string()])),
            ]),
            "InvalidArgument",
            "only metadata, idempotency_key and paused may come with it (got allow_out)",
        ),
        (
            "holder",
            opts(vec![("clone_of", Value::from("ok-2"))]),
            "Conflict",
            "network 'holder' exists and was not made as a clone",
        ),
    ];
    for (id, o, name, fragment) in cases {
        let e = c.ensure(id, o).await.unwrap_err();
        assert_eq!(
            e.name,
            format!("org.cube.NetworkAgent.Error.{name}"),
            "{id}: {e:?}"
        );
        assert!(
            e.message.contains(fragment),
            "{id}: {:?} should contain {fragment:?}",
            e.message
        );
        assert_eq!(
            snapshot(&env, &c).await,
            before,
            "a failed call changed state ({fragment})"
        );
    }
    for id in ["", "a b"] {
        assert_eq!(
            c.get(id).await.unwrap_err().name,
            "org.cube.NetworkAgent.Error.InvalidArgument"
        );
        assert_eq!(
            c.release(id).await.unwrap_err().name,
            "org.cube.NetworkAgent.Error.InvalidArgument"
        );
        assert_eq!(
            c.open_tap(id).await.unwrap_err().name,
            "org.cube.NetworkAgent.Error.InvalidArgument"
        );
    }
    assert_eq!(
        c.reconcile("nope").await.unwrap_err().name,
        "org.cube.NetworkAgent.Error.NotFound"
    );
    assert!(env.log().contains("network ensured"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_exhaustion_is_reported_and_recoverable() {
    require_root!();
    // A /29 has 5 usable addresses.
    let env = Env::new(&["--pool-cidr", "10.77.0.0/29", "--warm-pool", "2"]);
    let c = env.client().await;
    for i in 0..5 {
        c.ensure(&format!("s{i}"), opts(vec![])).await.unwrap();
    }
    let before = snapshot(&env, &c).await;
    let e = c.ensure("s5", opts(vec![])).await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.NodeFull");
    assert!(
        e.message.starts_with("node full (addresses): ") && e.message.contains("10.77.0.0/29"),
        "{}",
        e.message
    );
    assert_eq!(snapshot(&env, &c).await, before);
    assert!(c.release("s2").await.unwrap());
    let again = c.ensure("s5", opts(vec![])).await.unwrap();
    assert_eq!(
        s(&again, "sandbox_ip"),
        "10.77.0.4",
        "the only free address"
    );
    let (healthy, checks) = c.health().await;
    assert!(!healthy, "no uplink and no free address in this namespace");
    assert!(checks.iter().any(|(n, ok, _)| n == "addresses" && !ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_networks_with_16_callers_then_nothing_left() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    let capacity = c.property_u32("FreeAddresses").await;
    let mut tasks = vec![];
    for t in 0..16 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = vec![];
            for i in (t..200).step_by(16) {
                let id = format!("many-{i}");
                let d = c
                    .ensure(
                        &id,
                        opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
                    )
                    .await
                    .unwrap();
                out.push(d);
            }
            out
        }));
    }
    let mut nets = vec![];
    for t in tasks {
        nets.extend(t.await.unwrap());
    }
    assert_eq!(nets.len(), 200);
    let ips: BTreeSet<String> = nets.iter().map(|d| s(d, "sandbox_ip")).collect();
    let taps: BTreeSet<String> = nets.iter().map(|d| s(d, "tap_name")).collect();
    let hports: BTreeSet<u16> = nets.iter().map(|d| mappings(d)[0].2).collect();
    assert_eq!((ips.len(), taps.len(), hports.len()), (200, 200, 200));
    assert_eq!(env.sandbox_taps(), taps);
    assert_eq!(env.neighbours().len(), 200);
    assert_eq!(c.property_u32("ActiveNetworks").await, 200);
    assert_eq!(c.property_u32("FreeAddresses").await, capacity - 200);

    let mut tasks = vec![];
    for t in 0..16 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in (t..200).step_by(16) {
                assert!(c.release(&format!("many-{i}")).await.unwrap());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        env.sandbox_taps().is_empty(),
        "released TAPs are renamed at once, even surplus ones"
    );
    assert!(env.neighbours().is_empty());
    assert!(c.list().await.is_empty());
    assert_eq!(c.property_u32("FreeAddresses").await, capacity);
    // Surplus TAPs are deleted in the background: the pool keeps at most
    // twice its size (16) idle, so ensure/release churn recycles TAPs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while env.pool_taps().len() > 32 {
        assert!(
            std::time::Instant::now() < deadline,
            "pool never shrank: {}",
            env.pool_taps().len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_id_calls_are_serialised() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    // 16 concurrent ensures of one id: one network, all replies identical.
    let mut tasks = vec![];
    for _ in 0..16 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.ensure("same", opts(vec![])).await.unwrap()
        }));
    }
    let mut replies = vec![];
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert!(replies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(env.sandbox_taps().len(), 1);
    // Concurrent release + ensure storms on one id end consistent.
    let mut tasks = vec![];
    for i in 0..16 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                c.release("same").await.map(|_| ())
            } else {
                c.ensure("same", opts(vec![])).await.map(|_| ())
            }
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let present = c.get("same").await.is_ok();
    assert_eq!(env.sandbox_taps().len(), usize::from(present));
    assert_eq!(env.neighbours().len(), usize::from(present));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_networks_and_reconcile_repairs_drift() {
    require_root!();
    let mut env = Env::new(&[]);
    let c = env.client().await;
    let mut nets = vec![];
    for i in 0..5 {
        nets.push(
            c.ensure(
                &format!("r{i}"),
                opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
            )
            .await
            .unwrap(),
        );
    }
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    for n in &nets {
        let id = s(n, "sandbox_id");
        let got = c.get(&id).await.unwrap();
        for k in ["sandbox_ip", "tap_name", "network_handle"] {
            assert_eq!(s(&got, k), s(n, k));
        }
        assert_eq!(mappings(&got), mappings(n));
        assert_eq!(
            tap_info(&c.open_tap(&id).await.unwrap()).name,
            s(n, "tap_name")
        );
    }
    assert_eq!(env.sandbox_taps().len(), 5);
    let (_, checks) = c.health().await;
    let rec = checks.iter().find(|c| c.0 == "recovery").unwrap();
    assert!(rec.1 && rec.2.contains("adopted 5"), "{rec:?}");

    // Drift: a TAP set down, a neighbour deleted, a TAP deleted, an orphan.
    let t0 = s(&nets[0], "tap_name");
    let t1 = s(&nets[1], "tap_name");
    env.ns_cmd(&["ip", "link", "set", &t0, "down"]);
    env.ns_cmd(&[
        "ip",
        "neigh",
        "del",
        &s(&nets[2], "sandbox_ip"),
        "dev",
        "cube-dev",
    ]);
    env.ns_cmd(&["ip", "link", "del", &t1]);
    env.ns_cmd(&["ip", "tuntap", "add", "ctapc0a83f00", "mode", "tap"]);
    let report = c.reconcile("").await.unwrap();
    let repaired: Vec<String> = Vec::try_from(report["repaired"].try_clone().unwrap()).unwrap();
    let removed: Vec<String> = Vec::try_from(report["removed"].try_clone().unwrap()).unwrap();
    assert_eq!(u(&report, "checked"), 5);
    assert!(
        repaired
            .iter()
            .any(|r| r.contains(&t0) && r.contains("down")),
        "{repaired:?}"
    );
    assert!(
        repaired
            .iter()
            .any(|r| r.contains(&t1) && r.contains("recreated")),
        "{repaired:?}"
    );
    assert!(
        repaired.iter().any(|r| r.contains("neighbour")),
        "{repaired:?}"
    );
    assert!(
        removed.iter().any(|r| r.contains("ctapc0a83f00")),
        "{removed:?}"
    );
    let links = env.links();
    assert!(links[&t0].up && links[&t1].up);
    assert_eq!(env.neighbours().len(), 5);
    assert_eq!(tap_info(&c.open_tap("r1").await.unwrap()).name, t1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while env.links().contains_key("ctapc0a83f00") {
        assert!(
            std::time::Instant::now() < deadline,
            "orphan TAP not deleted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A second reconcile finds nothing to do.
    let again = c.reconcile("").await.unwrap();
    let repaired: Vec<String> = Vec::try_from(again["repaired"].try_clone().unwrap()).unwrap();
    assert!(repaired.is_empty(), "{repaired:?}");

    // A clean stop exits 0 and leaves the networks for the next start.
    assert!(env.stop_agent().success());
    env.start_agent();
    assert_eq!(env.client().await.list().await.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn introspection_matches_committed_xml() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    c.ensure("intro", opts(vec![])).await.unwrap();
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/dbus/org.cube.NetworkAgent.xml"
    ))
    .unwrap();
    let live_manager = c.introspect("/org/cube/NetworkAgent").await;
    let live_network = c.introspect("/org/cube/NetworkAgent/network/intro").await;
    for (iface, live) in [
        ("org.cube.NetworkAgent", &live_manager),
        ("org.cube.NetworkAgent.Network", &live_network),
    ] {
        let want = interface_block(&committed, iface)
            .unwrap_or_else(|| panic!("{iface} missing from dbus/org.cube.NetworkAgent.xml"));
        let got = interface_block(live, iface)
            .unwrap_or_else(|| panic!("{iface} missing from live introspection"));
        assert_eq!(
            normalise(&got),
            normalise(&want),
            "{iface} differs from the committed XML; live:\n{got}"
        );
    }
    assert!(live_manager.contains("org.freedesktop.DBus.ObjectManager"));
}

fn interface_block(xml: &str, name: &str) -> Option<String> {
    let start = xml.find(&format!("<interface name=\"{name}\">"))?;
    let end = start + xml[start..].find("</interface>")? + "</interface>".len();
    Some(xml[start..end].to_owned())
}

fn normalise(xml: &str) -> String {
    let mut text = xml.to_owned();
    while let Some(start) = text.find("<!--") {
        let end = text[start..]
            .find("-->")
            .map_or(text.len(), |e| start + e + 3);
        text.replace_range(start..end, "");
    }
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("<!--"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_properties_and_object_manager() {
    use futures::StreamExt;
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    let rule = zbus::MatchRule::builder()
        .msg_type(zbus::message::Type::Signal)
        .sender("org.cube.NetworkAgent")
        .unwrap()
        .build();
    let mut signals = zbus::MessageStream::for_match_rule(rule, &c.conn, Some(64))
        .await
        .unwrap();
    let net = c.ensure("sig-1", opts(vec![])).await.unwrap();
    let mut seen: Vec<String> = vec![];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    // PropertiesChanged is coalesced (one per 200 ms tick at most): wait
    // for it, with ActiveNetworks = 1, before releasing.
    for (wanted, release_after) in [
        (
            &["NetworkEnsured", "InterfacesAdded", "PropertiesChanged"][..],
            true,
        ),
        (&["NetworkReleased", "InterfacesRemoved"][..], false),
    ] {
        while !wanted.iter().all(|w| seen.iter().any(|s| s == w)) {
            let msg = tokio::time::timeout_at(deadline, signals.next())
                .await
                .unwrap_or_else(|_| panic!("signals seen so far: {seen:?}"))
                .unwrap()
                .unwrap();
            let h = msg.header();
            let member = h.member().unwrap().to_string();
            match member.as_str() {
                "NetworkEnsured" => {
                    let (id, dict): (String, common::Dict) = msg.body().deserialize().unwrap();
                    assert_eq!(id, "sig-1");
                    assert_eq!(s(&dict, "tap_name"), s(&net, "tap_name"));
                    assert_eq!(s(&dict, "network_handle"), s(&net, "network_handle"));
                    assert_eq!(s(&dict, "change"), "created");
                    // Slim: who and what happened; the object carries the rest.
                    assert!(!dict.contains_key("routes"), "{dict:?}");
                }
                "NetworkReleased" => {
                    let (id,): (String,) = msg.body().deserialize().unwrap();
                    assert_eq!(id, "sig-1");
                }
                "PropertiesChanged" => {
                    let (iface, changed, _): (
                        String,
                        HashMap<String, zbus::zvariant::OwnedValue>,
                        Vec<String>,
                    ) = msg.body().deserialize().unwrap();
                    if h.path().unwrap().as_str() != "/org/cube/NetworkAgent" {
                        continue;
                    }
                    assert_eq!(iface, "org.cube.NetworkAgent");
                    let Some(active) = changed.get("ActiveNetworks") else {
                        continue;
                    };
                    assert_eq!(u32::try_from(active.try_clone().unwrap()).unwrap(), 1);
                }
                _ => {}
            }
            seen.push(member);
        }
        if release_after {
            assert!(c.release("sig-1").await.unwrap());
        }
    }

    // The ObjectManager lists one object per network with its properties.
    c.ensure("sig.2", opts(vec![])).await.unwrap();
    let reply = c
        .conn
        .call_method(
            Some("org.cube.NetworkAgent"),
            "/org/cube/NetworkAgent",
            Some("org.freedesktop.DBus.ObjectManager"),
            "GetManagedObjects",
            &(),
        )
        .await
        .unwrap();
    type Managed = HashMap<
        zbus::zvariant::OwnedObjectPath,
        HashMap<String, HashMap<String, zbus::zvariant::OwnedValue>>,
    >;
    let objects: Managed = reply.body().deserialize().unwrap();
    let networks: Vec<(&str, &HashMap<String, zbus::zvariant::OwnedValue>)> = objects
        .iter()
        .filter_map(|(p, ifaces)| {
            ifaces
                .get("org.cube.NetworkAgent.Network")
                .map(|i| (p.as_str(), i))
        })
        .collect();
    assert_eq!(
        networks.len(),
        1,
        "{:?}",
        objects.keys().collect::<Vec<_>>()
    );
    let (path, props) = networks[0];
    assert_eq!(path, "/org/cube/NetworkAgent/network/sig_2e2");
    assert_eq!(
        String::try_from(props["SandboxId"].try_clone().unwrap()).unwrap(),
        "sig.2"
    );

    // A converged network: NetworkEnsured says "updated" and which keys
    // changed.
    c.ensure("sig.2", opts(vec![("mtu", Value::from(1400u32))]))
        .await
        .unwrap();
    loop {
        let msg = tokio::time::timeout(std::time::Duration::from_secs(5), signals.next())
            .await
            .expect("NetworkEnsured for the update")
            .unwrap()
            .unwrap();
        if msg.header().member().map(|m| m.as_str()) != Some("NetworkEnsured") {
            continue;
        }
        let (id, dict): (String, common::Dict) = msg.body().deserialize().unwrap();
        if id != "sig.2" || s(&dict, "change") == "created" {
            continue;
        }
        assert_eq!(s(&dict, "change"), "updated");
        let changed: Vec<String> = dict["changed"].try_clone().unwrap().try_into().unwrap();
        assert_eq!(changed, ["mtu"], "{dict:?}");
        break;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_path_without_a_warm_pool() {
    require_root!();
    let env = Env::new(&["--warm-pool", "0"]);
    let c = env.client().await;
    assert_eq!(c.property_u32("IdleTaps").await, 0);
    let net = c.ensure("cold-1", opts(vec![])).await.unwrap();
    let tap = s(&net, "tap_name");
    assert!(env.links()[&tap].up);
    assert_eq!(tap_info(&c.open_tap("cold-1").await.unwrap()).name, tap);
    assert!(c.release("cold-1").await.unwrap());
    // With no pool to return to, the TAP is deleted in the background.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !env.pool_taps().is_empty() || !env.sandbox_taps().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "TAP not deleted: {:?}",
            env.links().keys()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Health says when the agent's descriptors cannot hold a full pool (one
/// TAP fd per network): RLIMIT_NOFILE lowered under it flips `fd_limits`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_descriptor_limits_below_a_full_pool() {
    require_root!();
    let (env, _world) = common::world::node(&[]);
    let c = env.client().await;
    let fd_check = |checks: &[(String, bool, String)]| {
        checks
            .iter()
            .find(|c| c.0 == "fd_limits")
            .cloned()
            .unwrap_or_else(|| panic!("no fd_limits check: {checks:?}"))
    };
    let (healthy, checks) = c.health().await;
    let ok = fd_check(&checks);
    assert!(healthy && ok.1, "{checks:?}");
    let pid = env.agent_pid().to_string();
    let set = |limit: &str| {
        let st = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={limit}")])
            .status()
            .unwrap();
        assert!(st.success(), "prlimit {limit}");
    };
    let hard = std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
        .unwrap();
    set(&format!("4096:{hard}"));
    let (healthy, checks) = c.health().await;
    let low = fd_check(&checks);
    assert!(!healthy && !low.1, "{checks:?}");
    assert!(
        low.2.contains("RLIMIT_NOFILE 4096") && low.2.contains("LimitNOFILE"),
        "{low:?}"
    );
    set(&format!("{hard}:{hard}"));
    let (_, checks) = c.health().await;
    assert!(fd_check(&checks).1, "{checks:?}");
}

/// Every refused request is logged once at the default level with who
/// asked, the method, the sandbox id and the error; a flood from one
/// caller is cut to a burst (the journal cannot be filled by one uid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_are_logged_and_rate_limited() {
    require_root!();
    let env = Env::new(&[]);
    let c = env.client().await;
    let e = c.get("nope").await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.NotFound");
    let e = c
        .ensure(
            "bad",
            opts(vec![("mtu", zbus::zvariant::Value::from(5u32))]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.InvalidArgument");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let lines = loop {
        let log = env.log();
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains("request refused"))
            .map(str::to_owned)
            .collect();
        if lines.len() >= 2 || std::time::Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for (l, method, id, err) in [
        (&lines[0], "GetNetwork", "nope", "NotFound"),
        (&lines[1], "EnsureNetwork", "bad", "InvalidArgument"),
    ] {
        assert!(l.contains(" INFO "), "{l}");
        for want in [
            format!("method=\"{method}\""),
            format!("sandbox_id=\"{id}\""),
            format!("error=\"{err}\""),
            "edge=\"dbus\"".into(),
            "uid=0".into(),
        ] {
            assert!(l.contains(&want), "{want} missing in {l}");
        }
    }
    // A flood: 100 refusals, at most the burst is logged.
    for i in 0..100 {
        let _ = c.get(&format!("flood-{i}")).await;
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let flood = env
        .log()
        .lines()
        .filter(|l| l.contains("request refused") && l.contains("flood-"))
        .count();
    assert_eq!(
        flood,
        cube_network_agent::refusals::BURST as usize - 2,
        "the burst per window minus the two refusals above"
    );
}
