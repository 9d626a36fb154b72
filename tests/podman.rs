//! podman as a real client of cube-cni: Debian's podman 4.3 (rootful, the
//! CNI backend) driven by its CLI against the agent, in the test's node
//! namespace (`nsenter --net`), with `examples/cni/10-cube.conflist` as a
//! user installs it (plus the test bus's address). Covers what a podman
//! user does with `--network cube` (docs/podman.md): run, exec, stop, rm
//! and the release; several at once; `-p` for TCP and UDP from the world
//! (IPv4 and IPv6) and from the node's 127.0.0.1 while conmon holds the
//! published port,
//! and nothing after rm, and across `network reload`; a host service that
//! listened first keeps its port; `--ip` (CNI_ARGS `IP`) and `--ip --ip6` (the `ips` capability);
//! a container removed while the agent is down, freed once it is back; a
//! container that outlives an agent restart.
//!
//! Nothing of the host's is touched: podman runs in a mount namespace of
//! the test's own (tmpfs over /run and /var/lib: its netns mounts, libpod's
//! and runc's state, the CNI cache), with a private containers.conf
//! (CONTAINERS_CONF), storage root and runroot, the containers' cgroups under a parent of its own, and an image
//! imported from a directory of symlinks into the host's read-only /usr
//! (busybox, python3), so no registry is needed.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::world::{
    self, World, in_netns, tcp_exchange, tcp_exchange_in, udp_exchange, udp_exchange_in,
};
use common::{Env, s};
use serde_json::json;

const IMAGE: &str = "localhost/cube-test:latest";
const GUEST: &str = "169.254.68.6/30";

/// The container's services, both families: TCP 8080 answers "tpong:" +
/// request, UDP 8081 "upong:" + datagram.
const ECHO: &str = r#"
import socket, threading
def tcp():
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", 8080))
    s.listen(16)
    while True:
        c, _ = s.accept()
        c.settimeout(2)
        try:
            d = c.recv(4096)
        except OSError:
            d = b""
        c.sendall(b"tpong:" + d)
        c.close()
threading.Thread(target=tcp, daemon=True).start()
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
u.bind(("::", 8081))
while True:
    d, a = u.recvfrom(4096)
    u.sendto(b"upong:" + d, a)
"#;

/// podman with private state in the node namespace of `env`.
struct Podman {
    dir: PathBuf,
    node_ns: String,
}

fn sh(cmd: &str) -> Output {
    Command::new("sh").args(["-c", cmd]).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

impl Podman {
    fn new(env: &Env) -> Podman {
        let dir = env.dir.join("podman");
        std::fs::create_dir_all(dir.join("netd")).unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let p = Podman {
            dir: dir.clone(),
            node_ns: env.ns.clone(),
        };
        // The plugin where a user installs it, the conflist as shipped
        // with the test bus's address.
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_cube-cni"), dir.join("bin/cube-cni"))
            .unwrap();
        let shipped: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cni/10-cube.conflist"),
            )
            .unwrap(),
        )
        .unwrap();
        let mut list = shipped.clone();
        list["plugins"][0]["dbusAddress"] = json!(env.address);
        list["plugins"][0]["timeoutMs"] = json!(3000);
        std::fs::write(dir.join("netd/10-cube.conflist"), list.to_string()).unwrap();
        // Root here lacks CAP_SYS_RESOURCE: runc cannot raise a limit
        // above the hard one (docs/podman.md).
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit(2) writes into the rlimit we pass.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let nofile = lim.rlim_max.min(1 << 20);
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[containers]\n\
                 default_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc=1024:1024\"]\n\
                 [network]\n\
                 network_backend = \"cni\"\n\
                 cni_plugin_dirs = [\"{bin}\"]\n\
                 network_config_dir = \"{netd}\"\n\
                 [engine]\n\
                 cgroup_manager = \"cgroupfs\"\n\
                 events_logger = \"file\"\n",
                bin = dir.join("bin").display(),
                netd = dir.join("netd").display(),
            ),
        )
        .unwrap();
        // A mount namespace of its own, kept by a bind mount of its file:
        // every podman command enters it, so the namespace mounts one
        // leaves in /run/netns are there for the next.
        let d = dir.display();
        let out = sh(&format!(
            "set -e; mkdir -p {d}/mnt; mount --bind {d}/mnt {d}/mnt; \
             mount --make-private {d}/mnt; touch {d}/mnt/ns; \
             unshare --mount={d}/mnt/ns --propagation private sh -c \
             'mount -t tmpfs -o mode=755 podman-run /run && mkdir -p /run/netns /run/lock && \
              mount -t tmpfs -o mode=755 podman-lib /var/lib'"
        ));
        assert!(out.status.success(), "mount namespace: {}", text(&out));
        // The image: the host's /usr (busybox, python3) comes in with
        // -v /usr:/usr:ro.
        let rootfs = dir.join("rootfs");
        for d in ["usr", "etc", "proc", "sys", "dev", "tmp", "run", "var"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        for l in ["bin", "sbin", "lib", "lib64"] {
            std::os::unix::fs::symlink(format!("usr/{l}"), rootfs.join(l)).unwrap();
        }
        std::fs::write(rootfs.join("echo.py"), ECHO).unwrap();
        let tar = dir.join("rootfs.tar");
        let out = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .output()
            .unwrap();
        assert!(out.status.success(), "tar: {}", text(&out));
        let out = p.run(&["import", &tar.display().to_string(), IMAGE]);
        assert!(out.status.success(), "podman import: {}", text(&out));
        p
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--mount={}", self.dir.join("mnt/ns").display()))
            .arg(format!("--net=/run/netns/{}", self.node_ns))
            .arg("podman")
            .arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .args(["--storage-driver", "vfs"])
            .args(args)
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .stdin(Stdio::null());
        c
    }

    /// The containers' cgroups live under a parent of the test's own,
    /// removed with it.
    fn cgroup_parent(&self) -> String {
        format!("/cube-podman-{}", self.node_ns)
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "podman {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `podman run -d` of the echo services on the cube network, with
    /// `extra` flags; the container's id, or podman's failure.
    fn start(&self, name: &str, extra: &[&str]) -> Result<String, String> {
        let parent = self.cgroup_parent();
        let mut args = vec![
            "run",
            "-d",
            "--cgroup-parent",
            &parent,
            "--name",
            name,
            "--network",
            "cube",
            "-v",
            "/usr:/usr:ro",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[IMAGE, "python3", "-u", "/echo.py"]);
        let out = self.run(&args);
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(text(&out))
        }
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["rm", "-af", "-t", "0"]);
        let d = self.dir.display();
        let _ = sh(&format!(
            "umount {d}/mnt/ns; umount {d}/mnt; rm -rf --one-file-system {d}; \
             for c in /sys/fs/cgroup/*{}; do find \"$c\" -depth -type d -exec rmdir {{}} +; done; \
             rmdir /sys/fs/cgroup/*/libpod_parent/conmon /sys/fs/cgroup/*/libpod_parent; true",
            self.cgroup_parent()
        ));
    }
}

/// The listeners on `port` in the node namespace (`ss`): conmon's
/// reservation of a published port.
fn node_listeners(ns: &str, proto: &str, port: u16) -> String {
    let flag = if proto == "udp" { "-Hulnp" } else { "-Hltnp" };
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .args(["ss", flag, &format!("sport = :{port}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

const T: Duration = Duration::from_secs(3);

/// TCP and UDP through the published ports 20090 (TCP) and 20091 (UDP),
/// from the world, from the node's 127.0.0.1 and from the node to its own
/// uplink address.
fn published_ports_answer(world: &World, node_ns: &str) {
    let got = wait_for("TCP through -p from the world", 10, || {
        world
            .tcp_connect(World::node_addr(20090), b"w", T)
            .ok()
            .filter(|g| !g.is_empty())
    });
    assert_eq!(got, b"tpong:w");
    let got = world
        .udp_send_recv(World::node_addr(20091), b"w", T)
        .expect("UDP through -p from the world");
    assert_eq!(got, b"upong:w");
    let lo = |port| SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let got = in_netns(node_ns, move || tcp_exchange(lo(20090), b"n", T))
        .expect("TCP through -p from 127.0.0.1");
    assert_eq!(got, b"tpong:n");
    let got = in_netns(node_ns, move || udp_exchange(lo(20091), b"n", T))
        .expect("UDP through -p from 127.0.0.1");
    assert_eq!(got, b"upong:n");
    let got = in_netns(node_ns, move || {
        tcp_exchange(World::node_addr(20090), b"u", T)
    })
    .expect("TCP through -p from the node to its own address");
    assert_eq!(got, b"tpong:u");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_run_ports_ip_and_release() {
    require_root!();
    // The node has IPv6 too: published ports answer on its IPv6 address.
    let mut env = Env::new(&[]);
    let world = World::attach(&env);
    world.add_ipv6(&[]);
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    let p = Podman::new(&env);

    // run, exec: the guest address and a default route; the network is
    // the agent's veth attachment.
    let id = p
        .start("web", &["-p", "20090:8080", "-p", "20091:8081/udp"])
        .expect("podman run -p");
    let addr = p.ok(&["exec", "web", "ip", "-o", "-4", "addr", "show", "eth0"]);
    assert!(addr.contains(GUEST), "{addr}");
    let route = p.ok(&["exec", "web", "ip", "route", "show", "default"]);
    assert!(route.contains("via 169.254.68.5"), "{route}");
    let nets = c.list().await;
    assert_eq!(nets.len(), 1, "{nets:?}");
    assert_eq!(s(&nets[0], "attach"), "veth");
    // Recorded: the mappings win over conmon's later sockets.
    assert!(bool::try_from(nets[0]["mapping_wins"].try_clone().unwrap()).unwrap());
    let meta: std::collections::HashMap<String, String> =
        nets[0]["metadata"].try_clone().unwrap().try_into().unwrap();
    assert_eq!(meta.get("cni.container_id"), Some(&id));
    // conmon holds both published ports in the node's namespace (podman
    // reserves what it publishes), and the mappings still take the
    // traffic: from the world and from 127.0.0.1, TCP and UDP.
    assert!(node_listeners(&env.ns, "tcp", 20090).contains("conmon"));
    assert!(node_listeners(&env.ns, "udp", 20091).contains("conmon"));
    published_ports_answer(&world, &env.ns);
    let six = |port| std::net::SocketAddr::new(world::NODE_IP6.into(), port);
    let got = tcp_exchange_in(&world.ns, six(20090), b"w6", T).expect("TCP over IPv6");
    assert_eq!(got, b"tpong:w6");
    let got = udp_exchange_in(&world.ns, six(20091), b"w6", T).expect("UDP over IPv6");
    assert_eq!(got, b"upong:w6");
    // `network reload` tears the network down and makes it again while
    // conmon keeps holding the ports, asking for the addresses podman
    // read back (the container's own 169.254.68.6 and its IPv6 address):
    // the same attachment maps over its runtime's reservations again.
    p.ok(&["network", "reload", "web"]);
    assert_eq!(c.list().await.len(), 1);
    published_ports_answer(&world, &env.ns);

    // stop ends the network (DEL), rm removes the container; nothing
    // answers on the ports afterwards.
    p.ok(&["stop", "-t", "1", "web"]);
    assert!(c.list().await.is_empty(), "podman stop ran DEL");
    p.ok(&["rm", "web"]);
    assert!(
        world
            .tcp_connect(World::node_addr(20090), b"w", Duration::from_secs(1))
            .is_err()
    );
    assert!(
        world
            .udp_send_recv(World::node_addr(20091), b"w", Duration::from_secs(1))
            .is_err()
    );

    // A host service that listened first keeps its port: ADD refuses it,
    // naming it, and the service goes on answering.
    let _host = world::Server::tcp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 20095),
        b"host:",
    );
    let e = p
        .start("taken", &["-p", "20095:8080"])
        .expect_err("a port a host service holds");
    assert!(e.contains("20095"), "{e}");
    let got = world.tcp_connect(World::node_addr(20095), b"x", T).unwrap();
    assert_eq!(got, b"host:x");
    let _ = p.run(&["rm", "-f", "taken"]);
    assert!(c.list().await.is_empty());

    // --ip: an address in the pool and free is the pod's (CNI_ARGS IP);
    // --ip with --ip6 (the ips capability) when they agree; taken or
    // outside the pool fails, naming it.
    p.start("fixed", &["--ip", "192.168.0.50"])
        .expect("--ip in the pool");
    let nets = c.list().await;
    assert_eq!(s(&nets[0], "sandbox_ip"), "192.168.0.50");
    let e = p.start("same", &["--ip", "192.168.0.50"]).unwrap_err();
    assert!(e.contains("192.168.0.50"), "{e}");
    let e = p.start("outside", &["--ip", "10.9.9.9"]).unwrap_err();
    assert!(e.contains("10.9.9.9"), "{e}");
    let six = &format!("--ip6=fd63:7562:6501::c0a8:{:x}", 51);
    let both = p.start("both", &["--ip", "192.168.0.51", six]);
    let e = p
        .start("mismatch", &["--ip", "192.168.0.52", six])
        .unwrap_err();
    assert!(e.contains("fd63:7562:6501::c0a8:33"), "{e}");
    both.expect("--ip with the --ip6 that follows from it");
    // --ip6 alone: the IPv4 address it carries.
    let only6 = format!("--ip6=fd63:7562:6501::c0a8:{:x}", 53);
    p.start("only6", &[&only6]).expect("--ip6 alone");
    let mut ips: Vec<String> = c.list().await.iter().map(|n| s(n, "sandbox_ip")).collect();
    ips.sort();
    assert_eq!(ips, ["192.168.0.50", "192.168.0.51", "192.168.0.53"]);
    for n in ["same", "outside", "mismatch"] {
        let _ = p.run(&["rm", "-f", n]);
    }
    p.ok(&["rm", "-f", "-t", "0", "fixed", "both", "only6"]);
    assert!(c.list().await.is_empty());

    // Four at once: four networks, four pod addresses, all released.
    let names = ["m1", "m2", "m3", "m4"];
    let runs: Vec<std::process::Child> = names
        .iter()
        .map(|n| {
            p.cmd(&[
                "run",
                "-d",
                "--name",
                n,
                "--network",
                "cube",
                "-v",
                "/usr:/usr:ro",
                IMAGE,
                "sleep",
                "600",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for r in runs {
        let out = r.wait_with_output().unwrap();
        assert!(out.status.success(), "concurrent run: {}", text(&out));
    }
    let nets = c.list().await;
    let mut ips: Vec<String> = nets.iter().map(|n| s(n, "sandbox_ip")).collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), 4, "{nets:?}");
    let mut rm = vec!["rm", "-f", "-t", "0"];
    rm.extend_from_slice(&names);
    p.ok(&rm);
    assert!(c.list().await.is_empty());
    drop(p);
    drop(world);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_across_agent_restarts_and_while_it_is_down() {
    require_root!();
    let (mut env, world) = world::node(&[]);
    let p = Podman::new(&env);

    // A container that outlives a kill -9 and restart of the agent keeps
    // its published ports, its network and its address.
    p.start("long", &["-p", "20090:8080", "-p", "20091:8081/udp"])
        .expect("podman run");
    let before = env.client().await.list().await;
    published_ports_answer(&world, &env.ns);
    env.kill_agent();
    env.start_agent();
    let c = env.client().await;
    assert_eq!(c.list().await, before);
    published_ports_answer(&world, &env.ns);
    let ping = p.ok(&[
        "exec",
        "long",
        "busybox",
        "ping",
        "-c1",
        "-W2",
        "169.254.68.5",
    ]);
    assert!(ping.contains("1 packets received"), "{ping}");

    // Removed while the agent is down: DEL fails (code 11) and podman
    // does not retry; the agent, back, finds the container's namespace
    // gone and releases the network: its address and ports are free.
    env.stop_agent();
    // (podman rm, or the cleanup conmon runs when the container exits,
    // logs the failed DEL; whichever ran it, the network stays recorded.)
    p.ok(&["rm", "-f", "-t", "0", "long"]);
    env.start_agent();
    let c = env.client().await;
    wait_for(
        "the network of a container removed while the agent was down",
        20,
        || {
            let c = &c;
            let nets = futures_lite_block(async move { c.list().await });
            nets.is_empty().then_some(())
        },
    );
    let log = env.log();
    assert!(
        log.contains("its container's network namespace is gone"),
        "the release is logged with its reason:\n{log}"
    );
    let metrics = Command::new(env!("CARGO_BIN_EXE_cubenetctl"))
        .arg("metrics")
        .env(
            "CUBENETCTL_REPORT",
            env.dir.join("report/org.cube.NetworkAgent"),
        )
        .output()
        .unwrap();
    let m = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        m.lines()
            .any(|l| l.starts_with("cube_network_agent_cni_networks_released_netns_gone_total 1")),
        "{m}"
    );
    // The ports are free again for the next container.
    p.start("next", &["-p", "20090:8080", "-p", "20091:8081/udp"])
        .expect("the freed ports");
    published_ports_answer(&world, &env.ns);
    p.ok(&["rm", "-f", "-t", "0", "next"]);
    assert!(c.list().await.is_empty());
    drop(p);
    drop(world);
}

/// Runs a future to completion from a synchronous closure inside a
/// multi-threaded runtime.
fn futures_lite_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}
