//! Restarts that must never strand a TAP or a filter, with a real guest
//! (smoltcp on the TAP fd) and a "world" namespace behind the uplink. The
//! agent is started by hand (no service manager, so no fd store): the
//! lost-fd path. Root only.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::flow::Flow;
use common::guest::Guest;
use common::world::{self, World, node};
use common::{Dict, Env, check, health_until, mappings, opts, ports};

const T: Duration = Duration::from_secs(5);

fn strings(d: &Dict, k: &str) -> Vec<String> {
    Vec::<String>::try_from(d[k].try_clone().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_keeps_its_flow_across_restarts_and_its_tap_comes_back_when_it_exits() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    let net = c
        .ensure(
            "held",
            opts(vec![("port_mappings", ports(&[("udp", 7000, 0, "")]))]),
        )
        .await
        .unwrap();
    let host_port = mappings(&net)[0].2;
    let g = Arc::new(Guest::start_default(c.open_tap("held").await.unwrap()));
    g.udp_echo(7000).unwrap();
    let echo = world.udp_echo(5454);
    assert_eq!(g.udp_send_recv(echo, b"warm", T).unwrap(), b"world:warm");

    // kill -9 and a clean stop, each followed by a start without any fd
    // handed back: the guest holds the TAP's only queue, so the agent
    // adopts the network without an fd of its own.
    let flow = Flow::start(g.clone(), echo, &world.ns, host_port, None);
    for clean in [false, true] {
        std::thread::sleep(Duration::from_millis(300));
        if clean {
            assert!(env.stop_agent().success(), "{}", env.log());
        } else {
            env.kill_agent();
        }
        std::thread::sleep(Duration::from_millis(300));
        env.start_agent();
    }
    std::thread::sleep(Duration::from_millis(300));
    // A restart of the same build skips the verifier: every program it
    // pinned is found with every map it uses (a map missing from
    // `maps::PINNED` made each start verify again, ~1 s).
    assert!(
        env.log()
            .contains("programs=\"pinned by an earlier start of this build\""),
        "{}",
        env.log()
    );
    let ((e_sent, e_back), (i_sent, i_back)) = flow.finish();
    eprintln!("egress {e_back}/{e_sent}, ingress {i_back}/{i_sent} across kill -9 and stop/start");
    assert!(e_sent > 20 && i_sent > 100, "{e_sent} {i_sent}");
    assert_eq!(e_back, e_sent, "guest -> world datagrams lost");
    assert_eq!(i_back, i_sent, "world -> host port -> guest datagrams lost");

    let c = env.client().await;
    // Healthy: a VMM holding its TAP is not a fault; Health says so.
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    let fds = check(&checks, "sandbox_links");
    assert!(fds.2.contains("held only by another process"), "{fds:?}");
    // OpenTap cannot hand out the TAP while the guest holds it...
    let e = c.open_tap("held").await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.TapBusy", "{e:?}");
    // ...nor can Reconcile take it back, and it is no error.
    let r = c.reconcile("held").await.unwrap();
    assert!(strings(&r, "errors").is_empty(), "{r:?}");

    // The holder exits: OpenTap re-attaches the TAP and hands out an fd,
    // and a new guest on it has its flows (same address, same port).
    drop(Arc::into_inner(g).expect("the flow threads are done"));
    let fd = c.open_tap("held").await.unwrap();
    assert_eq!(
        common::tap_info(&fd).name,
        common::s(&net, "tap_name"),
        "the fd is attached to the network's TAP"
    );
    let g2 = Guest::start_default(fd);
    g2.udp_echo(7000).unwrap();
    assert_eq!(g2.udp_send_recv(echo, b"again", T).unwrap(), b"world:again");
    let ns_w = world.ns.clone();
    assert_eq!(
        world::udp_exchange_in(&ns_w, World::node_addr(host_port), b"in", T).unwrap(),
        b"in"
    );
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert!(
        !check(&checks, "sandbox_links")
            .2
            .contains("held only by another process"),
        "{checks:?}"
    );
    // Fresh dups from now on, also for a second holder.
    drop(c.open_tap("held").await.unwrap());

    // A network released while adopted without an fd leaves no trace.
    drop(g2);
    env.kill_agent();
    let g3 = Guest::start_default(env_open_tap_after_restart(&mut env, "held").await);
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "a VMM holding its TAP is not a fault: {checks:#?}");
    assert!(
        check(&checks, "sandbox_links")
            .2
            .contains("held only by another process")
    );
    drop(g3);
    assert!(c.release("held").await.unwrap());
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert!(
        checks.iter().all(|c| !c.2.contains("held")),
        "released, yet in Health: {checks:#?}"
    );
}

/// The network's fd from before a kill (taken before killing), so the
/// restarted agent finds the TAP held.
async fn env_open_tap_after_restart(env: &mut Env, id: &str) -> std::os::fd::OwnedFd {
    env.start_agent();
    let c = env.client().await;
    let fd = c.open_tap(id).await.unwrap();
    env.kill_agent();
    env.start_agent();
    fd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_qdiscs_and_filters_are_reported_and_repaired() {
    require_root!();
    let (mut env, world) = node(&[]);
    let c = env.client().await;
    let net = c.ensure("f", opts(vec![])).await.unwrap();
    let tap = common::s(&net, "tap_name");
    let g = Guest::start_default(c.open_tap("f").await.unwrap());
    let echo = world.udp_echo(5656);
    assert_eq!(g.udp_send_recv(echo, b"a", T).unwrap(), b"world:a");
    let checks = health_until(&c, "healthy at start", |ok, _| ok).await;
    assert!(check(&checks, "datapath_filters").1);

    // An admin removes the TAP's clsact qdisc and the filter on lo.
    env.ns_cmd(&["tc", "qdisc", "del", "dev", &tap, "clsact"]);
    env.ns_cmd(&["tc", "filter", "del", "dev", "lo", "egress"]);
    let checks = health_until(&c, "Health reports both", |ok, checks| {
        let f = check(checks, "datapath_filters");
        !ok && !f.1 && f.2.contains(&tap) && f.2.contains("from_host on lo egress")
    })
    .await;
    eprintln!("{:?}", check(&checks, "datapath_filters"));
    // Really gone: the guest's packets no longer reach the datapath.
    assert!(
        g.udp_send_recv(echo, b"b", Duration::from_millis(800))
            .is_err()
    );

    let r = c.reconcile("").await.unwrap();
    let repaired = strings(&r, "repaired");
    assert!(strings(&r, "errors").is_empty(), "{r:?}");
    assert!(
        repaired
            .iter()
            .any(|m| m.starts_with("f: from_guest on ") && m.contains(&tap)),
        "{repaired:?}"
    );
    assert!(
        repaired
            .iter()
            .any(|m| m.contains("from_host on lo egress")),
        "{repaired:?}"
    );
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert_eq!(g.udp_send_recv(echo, b"c", T).unwrap(), b"world:c");
    // A second Reconcile finds nothing to do.
    let r = c.reconcile("").await.unwrap();
    assert!(strings(&r, "repaired").is_empty(), "{r:?}");

    // The shared block's filter (every TAP's from_guest at once).
    let block = "49342";
    env.ns_cmd(&["tc", "filter", "del", "block", block]);
    let checks = health_until(&c, "Health reports the block's filter", |ok, checks| {
        let f = check(checks, "datapath_filters");
        !ok && f.2.contains("from_guest on tc block 49342: no bpf filter")
    })
    .await;
    eprintln!("{:?}", check(&checks, "datapath_filters"));
    assert!(
        g.udp_send_recv(echo, b"e", Duration::from_millis(800))
            .is_err()
    );
    let r = c.reconcile("").await.unwrap();
    assert!(
        strings(&r, "repaired")
            .iter()
            .any(|m| m.starts_with("node: from_guest on tc block 49342: no bpf filter")),
        "{r:?}"
    );
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert_eq!(g.udp_send_recv(echo, b"f", T).unwrap(), b"world:f");

    // Removed while the agent is down: recovery checks the kernel, not
    // its own record of what it attached (the TAP's binding), and the load
    // puts the block's filter back.
    env.kill_agent();
    env.ns_cmd(&["tc", "qdisc", "del", "dev", &tap, "clsact"]);
    env.start_agent();
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert!(
        check(&checks, "recovery").2.contains("repaired 1"),
        "{checks:?}"
    );
    assert_eq!(g.udp_send_recv(echo, b"d", T).unwrap(), b"world:d");
    env.kill_agent();
    env.ns_cmd(&["tc", "filter", "del", "block", block]);
    env.start_agent();
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert_eq!(g.udp_send_recv(echo, b"g", T).unwrap(), b"world:g");
}

/// Churned TAPs leave nothing behind in the pinned maps: no entry for a
/// device that no longer exists (`tap_attached`, `sandboxes`), none for a
/// sandbox that was released (`by_ip`, port mappings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_leaves_no_map_entry_for_a_gone_device_or_sandbox() {
    use cube_network_agent::datapath::maps::{DpPortmapKey, DpPortmapVal, DpSandbox, DpTap};
    require_root!();
    // A pool of 1 keeps 2 idle TAPs: most released TAPs are deleted.
    let (mut env, _world) = node(&["--warm-pool", "1"]);
    let c = env.client().await;
    for i in 0..24 {
        let id = format!("churn-{i}");
        c.ensure(
            &id,
            opts(vec![("port_mappings", ports(&[("udp", 53, 0, "")]))]),
        )
        .await
        .unwrap();
        if i % 4 != 0 {
            assert!(c.release(&id).await.unwrap());
        }
    }
    let live: Vec<Dict> = c.list().await;
    assert_eq!(live.len(), 6);
    let live_ips: std::collections::BTreeSet<u32> = live
        .iter()
        .map(|d| {
            let ip: std::net::Ipv4Addr = common::s(d, "sandbox_ip").parse().unwrap();
            u32::from_ne_bytes(ip.octets())
        })
        .collect();
    // A TAP deleted while the agent is down (nothing hears the kernel's
    // notification): the reaper must notice on its own.
    env.kill_agent();
    let pool_tap = env.pool_taps().into_iter().next().expect("a pool TAP");
    env.ns_cmd(&["ip", "link", "del", &pool_tap]);
    env.start_agent();
    let pins = env.dir.join("bpf");
    let open = |name: &str| aya::maps::MapData::from_pin(pins.join(name)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let links: std::collections::BTreeSet<u32> =
            env.links().values().map(|l| l.ifindex).collect();
        let attached: aya::maps::HashMap<_, u32, u32> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("tap_attached"))).unwrap();
        let sandboxes: aya::maps::HashMap<_, u32, DpSandbox> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("sandboxes"))).unwrap();
        let by_ip: aya::maps::HashMap<_, u32, DpTap> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("by_ip"))).unwrap();
        let portmap: aya::maps::HashMap<_, DpPortmapKey, DpPortmapVal> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("portmap"))).unwrap();
        let stale_attached: Vec<u32> = attached
            .keys()
            .flatten()
            .filter(|i| !links.contains(i))
            .collect();
        let stale_sandboxes: Vec<u32> = sandboxes
            .iter()
            .flatten()
            .filter(|(i, sb)| !links.contains(i) || !live_ips.contains(&sb.sandbox_ip))
            .map(|(i, _)| i)
            .collect();
        let stale_by_ip: Vec<u32> = by_ip
            .keys()
            .flatten()
            .filter(|ip| !live_ips.contains(ip))
            .collect();
        let stale_ports = portmap
            .iter()
            .flatten()
            .filter(|(_, v)| !live_ips.contains(&v.sandbox_ip))
            .count();
        let n_attached = attached.keys().flatten().count();
        if stale_attached.is_empty()
            && stale_sandboxes.is_empty()
            && stale_by_ip.is_empty()
            && stale_ports == 0
        {
            eprintln!("after churn: {n_attached} tap_attached entries, all for existing TAPs");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stale entries: tap_attached {stale_attached:?}, sandboxes {stale_sandboxes:?}, \
             by_ip {stale_by_ip:?}, {stale_ports} port mappings"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
