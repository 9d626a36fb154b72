//! TAPs handed over by name (EnsureNetwork `tap_owner_uid`/`tap_owner_gid`)
//! to a VMM that opens them itself, as Firecracker does: `fc_open` below is
//! Firecracker's open sequence and nothing more, run as a given uid on a
//! thread of its own. The agent runs in its own namespace with a world
//! behind its uplink (`world::node`). Root only.

mod common;

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::flow::Flow;
use common::guest::Guest;
use common::world::{self, World, in_netns, node};
use common::{CallError, Client, Dict, Env, check, mappings, opts, ports, s, tap_holders};
use zbus::zvariant::Value;

const T: Duration = Duration::from_secs(5);
const OWNER: u32 = 4242;
const OTHER: u32 = 4343;

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const TUN_F_CSUM: libc::c_ulong = 0x01;
const TUN_F_TSO4: libc::c_ulong = 0x02;
const TUN_F_TSO6: libc::c_ulong = 0x04;
const TUN_F_UFO: libc::c_ulong = 0x10;

/// A `/dev/net/tun` node as distributions ship it (0666) in the test's
/// directory: this machine's own is root-only, and Firecracker's jailer
/// makes such a node in its chroot the same way.
fn tun_node(env: &Env) -> PathBuf {
    let path = env.dir.join("tun");
    let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mknod with a valid path; makedev(10, 200) is /dev/net/tun.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(10, 200)) };
    assert!(
        r == 0 || std::io::Error::last_os_error().kind() == std::io::ErrorKind::AlreadyExists,
        "mknod {path:?}: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: chmod with a valid path (mknod's mode is masked by umask).
    assert_eq!(unsafe { libc::chmod(c.as_ptr(), 0o666) }, 0);
    path
}

/// Firecracker's open of a TAP by name (`Tap::open_named`), as `uid`:`gid`
/// with no supplementary groups, in namespace `ns`: open the tun device
/// O_RDWR|O_NONBLOCK|O_CLOEXEC, TUNSETIFF IFF_TAP|IFF_NO_PI|IFF_VNET_HDR,
/// TUNSETOFFLOAD, TUNSETVNETHDRSZ 12. The errno of the first failure.
fn fc_open(ns: &str, tun: &Path, name: &str, uid: u32, gid: u32) -> Result<OwnedFd, i32> {
    let tun = CString::new(tun.as_os_str().as_encoded_bytes()).unwrap();
    let name = name.to_owned();
    in_netns(ns, move || {
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap();
        // The raw syscalls change this thread's credentials only (glibc's
        // wrappers would change every thread of the test).
        // SAFETY: plain syscalls on integers / a null list of 0 groups.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<u32>()),
                0
            );
            assert_eq!(libc::syscall(libc::SYS_setresgid, gid, gid, gid), 0);
            assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
        }
        // SAFETY: open with a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                tun.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(errno());
        }
        // SAFETY: a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ifreq is plain data; all zeroes is valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, b) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *d = b as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
        // SAFETY: TUNSETIFF takes a pointer to a live ifreq.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF as _, &mut req) } < 0 {
            return Err(errno());
        }
        let offload = TUN_F_CSUM | TUN_F_UFO | TUN_F_TSO4 | TUN_F_TSO6;
        // SAFETY: TUNSETOFFLOAD takes its flags by value.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD as _, offload) } < 0 {
            return Err(errno());
        }
        let hdr: libc::c_int = 12;
        // SAFETY: TUNSETVNETHDRSZ reads an int through the pointer.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETVNETHDRSZ as _, &hdr) } < 0 {
            return Err(errno());
        }
        Ok(fd)
    })
}

fn by_name(uid: u32, gid: Option<u32>, mut rest: Vec<(&str, Value<'_>)>) -> Dict {
    rest.push(("tap_owner_uid", Value::from(uid)));
    if let Some(g) = gid {
        rest.push(("tap_owner_gid", Value::from(g)));
    }
    opts(rest)
}

fn invalid(e: &CallError, key: &str) {
    assert_eq!(
        e.name, "org.cube.NetworkAgent.Error.InvalidArgument",
        "{e:?}"
    );
    assert!(e.message.starts_with(&format!("{key}: ")), "{e:?}");
}

/// Every process holding an fd of `name` but the test itself.
fn holders_but_us(name: &str) -> Vec<u32> {
    let me = std::process::id();
    tap_holders(name).into_iter().filter(|p| *p != me).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vmm_opens_its_tap_by_name_as_its_owner_only_until_release() {
    require_root!();
    let (env, world) = node(&[]);
    let tun = tun_node(&env);
    let c = env.client().await;
    let net = c
        .ensure(
            "fc",
            by_name(
                OWNER,
                None,
                vec![("port_mappings", ports(&[("udp", 7000, 0, "")]))],
            ),
        )
        .await
        .unwrap();
    let name = s(&net, "tap_name");
    assert!(name.starts_with("ctapn"), "{name}");
    assert_eq!(common::u(&net, "tap_owner_uid"), OWNER);
    // The agent holds no fd of it: the device is there for its owner.
    // (Not "nobody": this test binary's other tests, running at once in
    // namespaces of their own, hold TAPs of the same name, and fdinfo
    // names a TAP without its namespace: that check failed once in CI.)
    assert!(holders_but_us(&name).is_empty(), "{:?}", tap_holders(&name));
    let host_port = mappings(&net)[0].2;

    // Another uid: the kernel's owner check refuses it.
    assert_eq!(
        fc_open(&env.ns, &tun, &name, OTHER, OTHER).unwrap_err(),
        libc::EPERM
    );
    // The owner attaches, and its frames reach the world and back.
    let fd = fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap();
    assert_eq!(common::tap_info(&fd).name, name);
    let probe = fd.try_clone().unwrap();
    let g = Guest::start_default(fd);
    g.udp_echo(7000).unwrap();
    let echo = world.udp_echo(5454);
    assert_eq!(g.udp_send_recv(echo, b"fc", T).unwrap(), b"world:fc");
    assert_eq!(
        world::udp_exchange_in(&world.ns, World::node_addr(host_port), b"in", T).unwrap(),
        b"in"
    );
    // The owner holds the only queue; a second open is EBUSY.
    assert_eq!(
        fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap_err(),
        libc::EBUSY
    );

    // OpenTap has no fd to hand out.
    let e = c.open_tap("fc").await.unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.InvalidArgument");
    assert!(
        e.message
            .contains("handed over by name (tap_owner_uid: uid 4242)")
            && e.message.contains(&name),
        "{e:?}"
    );
    // A new owner while the VMM holds it: TapBusy, nothing changed.
    let e = c
        .ensure(
            "fc",
            by_name(
                OTHER,
                None,
                vec![("port_mappings", ports(&[("udp", 7000, host_port, "")]))],
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(e.name, "org.cube.NetworkAgent.Error.TapBusy", "{e:?}");
    assert_eq!(
        common::u(&c.get("fc").await.unwrap(), "tap_owner_uid"),
        OWNER
    );
    assert_eq!(g.udp_send_recv(echo, b"still", T).unwrap(), b"world:still");
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    assert!(
        check(&checks, "sandbox_links")
            .2
            .contains("1 TAPs handed over by name"),
        "{checks:#?}"
    );

    // A group: the uid must be in it too.
    let net_g = c
        .ensure("fcg", by_name(OWNER, Some(4545), vec![]))
        .await
        .unwrap();
    let name_g = s(&net_g, "tap_name");
    assert_eq!(common::u(&net_g, "tap_owner_gid"), 4545);
    assert_eq!(
        fc_open(&env.ns, &tun, &name_g, OWNER, OWNER).unwrap_err(),
        libc::EPERM
    );
    assert_eq!(
        fc_open(&env.ns, &tun, &name_g, OTHER, 4545).unwrap_err(),
        libc::EPERM
    );
    drop(fc_open(&env.ns, &tun, &name_g, OWNER, 4545).unwrap());
    // A group stays (the kernel cannot unset it).
    let e = c
        .ensure("fcg", by_name(OTHER, None, vec![]))
        .await
        .unwrap_err();
    invalid(&e, "tap_owner_gid");
    // Not held: a new owner applies, and only the new owner attaches.
    c.ensure("fcg", by_name(OTHER, Some(OTHER), vec![]))
        .await
        .unwrap();
    assert_eq!(
        fc_open(&env.ns, &tun, &name_g, OWNER, 4545).unwrap_err(),
        libc::EPERM
    );
    drop(fc_open(&env.ns, &tun, &name_g, OTHER, OTHER).unwrap());
    assert!(holders_but_us(&name_g).is_empty());

    // Release while the VMM holds it: cut off at once, the device gone
    // within seconds, the VMM's reads and writes fail, and its name
    // opens nothing.
    assert!(c.release("fc").await.unwrap());
    assert!(
        g.udp_send_recv(echo, b"after", Duration::from_millis(500))
            .is_err()
    );
    let frame = [0u8; 12 + 60];
    let deadline = Instant::now() + Duration::from_secs(5);
    let (w, r) = loop {
        // SAFETY: write/read on an fd we own, from/to live buffers.
        let w = unsafe { libc::write(probe.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        let werr = std::io::Error::last_os_error().raw_os_error();
        let mut buf = [0u8; 2048];
        // SAFETY: as above.
        let r = unsafe { libc::read(probe.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        let rerr = std::io::Error::last_os_error().raw_os_error();
        if w < 0 && werr == Some(libc::EBADFD) && r < 0 && rerr == Some(libc::EBADFD) {
            break (werr, rerr);
        }
        assert!(
            Instant::now() < deadline,
            "still usable: write {w} {werr:?}, read {r} {rerr:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((w, r), (Some(libc::EBADFD), Some(libc::EBADFD)));
    assert!(!env.links().contains_key(&name), "{name} still there");
    assert_eq!(
        fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap_err(),
        libc::EPERM,
        "a re-open by the old name"
    );
    drop(g);
}

/// The observable state of the node: networks (id, TAP, owner), the
/// sandboxes' TAPs, neighbours.
async fn state(
    c: &Client,
    env: &Env,
) -> (
    BTreeSet<String>,
    BTreeSet<String>,
    BTreeSet<(String, String)>,
) {
    let nets = c
        .list()
        .await
        .iter()
        .map(|n| {
            let owner = n
                .get("tap_owner_uid")
                .map(|v| u32::try_from(v.try_clone().unwrap()).unwrap());
            format!(
                "{} {} {owner:?} {:?}",
                s(n, "sandbox_id"),
                s(n, "tap_name"),
                mappings(n)
            )
        })
        .collect();
    (nets, env.sandbox_taps(), env.neighbours())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tap_owners_are_refused_by_name_and_change_nothing() {
    require_root!();
    let (env, world) = node(&[]);
    let c = env.client().await;
    c.ensure("byfd", opts(vec![])).await.unwrap();
    c.ensure("byname", by_name(0, None, vec![])).await.unwrap();
    let before = state(&c, &env).await;
    let netns = std::fs::File::open(format!("/run/netns/{}", world.ns)).unwrap();
    let veth = opts(vec![
        ("attach", Value::from("veth")),
        ("ifname", Value::from("eth0")),
        (
            "netns_fd",
            Value::from(zbus::zvariant::Fd::from(std::os::fd::AsFd::as_fd(&netns))),
        ),
        ("tap_owner_uid", Value::from(1000u32)),
    ]);
    let cases: Vec<(&str, Dict, &str)> = vec![
        ("new", by_name(u32::MAX, None, vec![]), "tap_owner_uid"),
        (
            "new",
            opts(vec![("tap_owner_gid", Value::from(1000u32))]),
            "tap_owner_gid",
        ),
        (
            "new",
            by_name(1000, Some(u32::MAX), vec![]),
            "tap_owner_gid",
        ),
        (
            "new",
            opts(vec![("tap_owner_uid", Value::from("1000"))]),
            "option tap_owner_uid",
        ),
        ("new", veth, "tap_owner_uid"),
        ("byfd", by_name(1000, None, vec![]), "tap_owner_uid"),
        ("byname", opts(vec![]), "tap_owner_uid"),
        ("byname", by_name(u32::MAX, None, vec![]), "tap_owner_uid"),
    ];
    for (id, o, key) in cases {
        let e = c.ensure(id, o).await.unwrap_err();
        invalid(&e, key);
        assert_eq!(state(&c, &env).await, before, "{id} {key}: {e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_keeps_a_by_name_guest_online_and_names_are_never_reused() {
    require_root!();
    let (mut env, world) = node(&[]);
    let tun = tun_node(&env);
    let c = env.client().await;
    let net = c
        .ensure(
            "vm",
            by_name(
                OWNER,
                None,
                vec![("port_mappings", ports(&[("udp", 7000, 0, "")]))],
            ),
        )
        .await
        .unwrap();
    let (name, host_port) = (s(&net, "tap_name"), mappings(&net)[0].2);
    let spare = s(
        &c.ensure("spare", by_name(OWNER, None, vec![]))
            .await
            .unwrap(),
        "tap_name",
    );
    let g = Arc::new(Guest::start_default(
        fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap(),
    ));
    g.udp_echo(7000).unwrap();
    let echo = world.udp_echo(5454);
    assert_eq!(g.udp_send_recv(echo, b"warm", T).unwrap(), b"world:warm");
    let mut names = BTreeSet::from([name.clone(), spare.clone()]);

    // kill -9 with traffic both ways, a start without any fd store.
    let flow = Flow::start(g.clone(), echo, &world.ns, host_port, None);
    std::thread::sleep(Duration::from_millis(300));
    env.kill_agent();
    std::thread::sleep(Duration::from_millis(300));
    env.start_agent();
    std::thread::sleep(Duration::from_millis(500));
    let ((e_sent, e_back), (i_sent, i_back)) = flow.finish();
    eprintln!("egress {e_back}/{e_sent}, ingress {i_back}/{i_sent} across kill -9");
    assert!(e_sent > 5 && i_sent > 20, "{e_sent} {i_sent}");
    assert_eq!(e_back, e_sent, "guest -> world datagrams lost");
    assert_eq!(i_back, i_sent, "world -> host port -> guest datagrams lost");
    // Adopted by name: the agent opened neither TAP, held or not (had it
    // opened the free one, its owner would get EBUSY now).
    assert!(holders_but_us(&name).is_empty() && holders_but_us(&spare).is_empty());
    drop(fc_open(&env.ns, &tun, &spare, OWNER, OWNER).unwrap());
    let c = env.client().await;
    let (ok, checks) = c.health().await;
    assert!(ok, "{checks:#?}");
    let links = check(&checks, "sandbox_links");
    assert!(
        links.2.contains("2 TAPs handed over by name")
            && !links.2.contains("held only by another process"),
        "{links:?}"
    );
    let r = c.reconcile("").await.unwrap();
    assert!(
        Vec::<String>::try_from(r["errors"].try_clone().unwrap())
            .unwrap()
            .is_empty()
    );
    assert!(holders_but_us(&spare).is_empty(), "Reconcile opened it");

    // Names are never used twice, across releases and restarts (the
    // released TAPs are gone from the kernel: only the agent's counter
    // remembers them).
    assert!(c.release("spare").await.unwrap());
    let n = s(
        &c.ensure("spare", by_name(OWNER, None, vec![]))
            .await
            .unwrap(),
        "tap_name",
    );
    assert!(names.insert(n.clone()), "{n} again");
    assert!(c.release("spare").await.unwrap());
    std::thread::sleep(Duration::from_secs(2));
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    for id in ["spare", "other"] {
        let n = s(
            &c.ensure(id, by_name(OWNER, None, vec![])).await.unwrap(),
            "tap_name",
        );
        assert!(
            names.insert(n.clone()),
            "{n} again after a restart: {names:?}"
        );
    }
    assert_eq!(g.udp_send_recv(echo, b"after", T).unwrap(), b"world:after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_is_restored_by_name() {
    require_root!();
    let (env, world) = node(&[]);
    let tun = tun_node(&env);
    let c = env.client().await;
    let src = c
        .ensure(
            "golden",
            opts(vec![("port_mappings", ports(&[("udp", 7000, 0, "")]))]),
        )
        .await
        .unwrap();
    let clone = c
        .ensure(
            "clone",
            by_name(OWNER, None, vec![("clone_of", Value::from("golden"))]),
        )
        .await
        .unwrap();
    assert_eq!(s(&clone, "cloned_from"), "golden");
    let name = s(&clone, "tap_name");
    assert!(
        name.starts_with("ctapn") && name != s(&src, "tap_name"),
        "{name}"
    );
    let (src_port, port) = (mappings(&src)[0].2, mappings(&clone)[0].2);
    assert_ne!(src_port, port);
    // A retry is the same clone.
    let again = c
        .ensure(
            "clone",
            by_name(OWNER, None, vec![("clone_of", Value::from("golden"))]),
        )
        .await
        .unwrap();
    assert_eq!(s(&again, "tap_name"), name);
    let g = Guest::start_default(fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap());
    g.udp_echo(7000).unwrap();
    let echo = world.udp_echo(5454);
    assert_eq!(g.udp_send_recv(echo, b"clone", T).unwrap(), b"world:clone");
    assert_eq!(
        world::udp_exchange_in(&world.ns, World::node_addr(port), b"in", T).unwrap(),
        b"in"
    );
}

/// One varlink call on the agent's socket (no fds): the reply object.
fn varlink(env: &Env, method: &str, params: serde_json::Value) -> serde_json::Value {
    use std::io::{Read, Write};
    let path = env.dir.join("run").join("org.cube.NetworkAgent");
    let mut sock = std::os::unix::net::UnixStream::connect(&path).unwrap();
    sock.set_read_timeout(Some(T)).unwrap();
    let msg = serde_json::json!({"method": format!("org.cube.NetworkAgent.{method}"), "parameters": params});
    let mut bytes = serde_json::to_vec(&msg).unwrap();
    bytes.push(0);
    sock.write_all(&bytes).unwrap();
    let mut reply = vec![];
    let mut b = [0u8; 1];
    while sock.read(&mut b).unwrap() == 1 && b[0] != 0 {
        reply.push(b[0]);
    }
    serde_json::from_slice(&reply).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn varlink_too_and_a_deleted_by_name_tap_is_made_again_for_its_owner() {
    require_root!();
    let (env, world) = node(&[]);
    let tun = tun_node(&env);
    // The same options over varlink.
    let r = varlink(
        &env,
        "EnsureNetwork",
        serde_json::json!({"sandbox_id": "vl", "options": {"tap_owner_uid": OWNER, "tap_owner_gid": OWNER}}),
    );
    let net = &r["parameters"]["network"];
    assert_eq!(
        (&net["tap_owner_uid"], &net["tap_owner_gid"]),
        (&serde_json::json!(OWNER), &serde_json::json!(OWNER)),
        "{r}"
    );
    let name = net["tap_name"].as_str().unwrap().to_owned();
    let r = varlink(
        &env,
        "EnsureNetwork",
        serde_json::json!({"sandbox_id": "vl2", "options": {"tap_owner_gid": OWNER}}),
    );
    assert!(
        r["error"].as_str().unwrap().ends_with("InvalidArgument")
            && r.to_string().contains("tap_owner_gid: needs tap_owner_uid"),
        "{r}"
    );

    // Deleted by hand: Reconcile makes it again, by name, for its owner,
    // and does not keep it.
    env.ns_cmd(&["ip", "link", "del", &name]);
    let c = env.client().await;
    let rep = c.reconcile("vl").await.unwrap();
    let repaired = Vec::<String>::try_from(rep["repaired"].try_clone().unwrap()).unwrap();
    assert!(
        repaired.iter().any(|r| r.contains(&format!(
            "TAP {name} was missing, recreated for uid {OWNER} gid {OWNER}"
        ))),
        "{repaired:?}"
    );
    assert!(holders_but_us(&name).is_empty(), "the agent holds it");
    assert_eq!(
        fc_open(&env.ns, &tun, &name, OTHER, OTHER).unwrap_err(),
        libc::EPERM
    );
    let g = Guest::start_default(fc_open(&env.ns, &tun, &name, OWNER, OWNER).unwrap());
    let echo = world.udp_echo(5454);
    assert_eq!(g.udp_send_recv(echo, b"again", T).unwrap(), b"world:again");
}
