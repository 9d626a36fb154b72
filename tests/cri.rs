//! Kubelet's path end to end: containerd 1.6's real CRI plugin (Debian
//! 12's, `tests/cri/containerd-cri.sh`) with cube-cni and the shipped
//! `examples/cni/10-cube.conflist` as its CNI, driven over CRI v1 by a
//! minimal client that plays kubelet (`tests/cri/cri.py`, gRPC from the
//! test venv). Pods with a hostPort, stop and remove, a second attempt
//! on the same port, three pods at once, the bandwidth annotations, and
//! what a pod reaches of its node. The agent runs in its own node
//! namespace facing a world namespace; containerd runs in that node
//! namespace with private state, and everything is torn down even on
//! failure.

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::world::{self, NODE_IP, Server, WORLD_IP, World, in_netns};
use common::{Client, Dict, Env, s};
use serde_json::Value;

/// The venv scripts/deps.sh --test makes, with grpcio and grpcio-tools.
const PYTHON: &str = "/opt/cube-network-agent-test/venv/bin/python";
const GUEST_IP: &str = "169.254.68.6";

fn cri_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cri")
}

/// A private containerd with the CRI plugin in `env`'s node namespace,
/// whose CNI is cube-cni (the built binary) with the example conflist
/// pointed at `env`'s bus. Torn down on drop.
struct Cri {
    state: String,
    sock: String,
    cgroup: String,
    cni_cache: PathBuf,
}

impl Cri {
    fn start(env: &Env) -> Cri {
        assert!(
            Path::new(PYTHON).exists(),
            "{PYTHON} missing: scripts/deps.sh --test makes the venv with grpcio"
        );
        let bin = env.dir.join("cnibin");
        std::fs::create_dir_all(&bin).unwrap();
        // containerd 1.6 sets up the pod's lo with the stock loopback plugin.
        for (target, name) in [
            (Path::new(env!("CARGO_BIN_EXE_cube-cni")), "cube-cni"),
            (Path::new("/usr/lib/cni/loopback"), "loopback"),
        ] {
            assert!(
                target.exists(),
                "{} missing (containernetworking-plugins)",
                target.display()
            );
            // A copy: the pods' DEL must find the binary that made them
            // even while cargo relinks the target.
            std::fs::copy(target, bin.join(name)).unwrap();
        }
        let netd = env.dir.join("netd");
        std::fs::create_dir_all(&netd).unwrap();
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cni/10-cube.conflist");
        let mut list: Value =
            serde_json::from_str(&std::fs::read_to_string(example).unwrap()).unwrap();
        list["plugins"][0]["dbusAddress"] = env.address.clone().into();
        std::fs::write(netd.join("10-cube.conflist"), list.to_string()).unwrap();
        let out = Command::new(cri_dir().join("containerd-cri.sh"))
            .arg("start")
            .env("NODE_NS", &env.ns)
            .env("CONF_DIR", &netd)
            .env("BIN_DIR", &bin)
            .output()
            .unwrap();
        let vars = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "containerd-cri.sh start: {vars} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let var = |k: &str| {
            vars.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{k} missing in {vars}"))
                .to_owned()
        };
        let cri = Cri {
            state: var("CRI_STATE"),
            sock: var("CRI_SOCK"),
            cgroup: var("CRI_CGROUP"),
            cni_cache: var("CRI_CNI_CACHE").into(),
        };
        // Kubelet waits for RuntimeReady and NetworkReady (in 1.6: a CNI
        // config loaded) before it runs pods.
        cri.ok(&["status", "--wait", "20"]);
        cri
    }

    /// One cri.py call: its JSON, or its error with containerd's last
    /// logged errors (a CNI failure's among them).
    fn call(&self, args: &[&str]) -> Result<Value, String> {
        let out = Command::new(PYTHON)
            .arg(cri_dir().join("cri.py"))
            .args(["--sock", &self.sock])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        if out.status.success() {
            return Ok(serde_json::from_slice(&out.stdout).unwrap());
        }
        let log = std::fs::read_to_string(Path::new(&self.state).join("containerd.log"))
            .unwrap_or_default();
        let errors: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("level=error") || l.contains("level=warning"))
            .collect();
        Err(format!(
            "cri.py {args:?}: {}\ncontainerd's last errors:\n{}",
            String::from_utf8_lossy(&out.stderr),
            errors[errors.len().saturating_sub(10)..].join("\n")
        ))
    }

    fn ok(&self, args: &[&str]) -> Value {
        self.call(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// RunPodSandbox in the cgroup the script cleans up; the pod's id.
    fn run_pod(&self, name: &str, extra: &[&str]) -> String {
        let mut args = vec!["run-pod", name, "--cgroup-parent", &self.cgroup];
        args.extend_from_slice(extra);
        self.ok(&args)["id"].as_str().unwrap().to_owned()
    }

    fn pod_status(&self, id: &str) -> Value {
        self.ok(&["pod-status", id])
    }

    /// CreateContainer + StartContainer of the busybox image running `cmd`.
    fn container(&self, pod: &str, name: &str, cmd: &str) -> String {
        let v = self.ok(&["create-start", pod, name, "--", "/bin/sh", "-c", cmd]);
        v["id"].as_str().unwrap().to_owned()
    }

    /// ExecSync `cmd` in the container: (exit code, stdout, stderr).
    fn exec(&self, cid: &str, cmd: &str) -> (i64, String, String) {
        let v = self.ok(&["exec", cid, "--timeout", "30", "--", "/bin/sh", "-c", cmd]);
        let text = |k: &str| v[k].as_str().unwrap_or("").to_owned();
        (
            v["exit_code"].as_i64().unwrap(),
            text("stdout"),
            text("stderr"),
        )
    }

    /// StopPodSandbox then RemovePodSandbox, as kubelet does.
    fn stop_and_remove(&self, id: &str) {
        self.ok(&["stop-pod", id]);
        self.ok(&["rm-pod", id]);
    }

    /// What containerd handed libcni for the pod's cube network (libcni's
    /// cache: CNI_ARGS and the capability args).
    fn cni_cache(&self, pod: &str) -> Value {
        let f = self.cni_cache.join(format!("results/cube-{pod}-eth0"));
        serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap()
    }
}

impl Drop for Cri {
    fn drop(&mut self) {
        let out = Command::new(cri_dir().join("containerd-cri.sh"))
            .args(["stop", &self.state])
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "containerd-cri.sh stop: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("containerd-cri.sh stop: {e}"),
        }
    }
}

/// The agent's network of a pod (cube-cni's id for it).
async fn network(c: &Client, pod: &str) -> Dict {
    c.get(&format!("cni:{pod}:eth0"))
        .await
        .unwrap_or_else(|e| panic!("no network for pod {pod}: {e:?}"))
}

fn metadata(net: &Dict) -> HashMap<String, String> {
    net["metadata"].try_clone().unwrap().try_into().unwrap()
}

fn num(net: &Dict, k: &str) -> u64 {
    u64::try_from(net[k].try_clone().unwrap()).unwrap()
}

/// The container's `nc -ll` server answers `pong` on the host port, from the
/// world (once its listener is up).
fn pong_from_world(world: &World, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match world.tcp_connect(World::node_addr(port), b"", Duration::from_secs(2)) {
            Ok(g) if g == b"pong\n" => return,
            r if Instant::now() > deadline => panic!("hostPort {port} from the world: {r:?}"),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The pod's sandbox is ready and its pod IP is the agent's sandbox
/// address; the result's other IPs list the fixed container address.
async fn assert_pod_ip(cri: &Cri, c: &Client, pod: &str) -> String {
    let st = cri.pod_status(pod);
    assert_eq!(st["state"], "SANDBOX_READY", "{st}");
    let net = network(c, pod).await;
    let ip = s(&net, "sandbox_ip");
    assert_eq!(st["ip"], ip.as_str(), "pod IP is the sandbox address: {st}");
    let extra: Vec<&str> = st["additional_ips"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(extra.contains(&GUEST_IP), "{st}");
    ip
}

/// A persistent server (a child per connection): `pong` to every client.
const SERVE_PONG: &str = "exec nc -ll -p 80 -e echo pong";

/// (a) a pod with a hostPort, through RunPodSandbox: served to the world
/// and to the node's 127.0.0.1; the pod IP is the sandbox address; the
/// network carries the pod's identity; the pod reaches the node at its
/// gateway. (b) StopPodSandbox releases the network, RemovePodSandbox
/// succeeds. (c) The pod again (attempt 1) on the same host port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_a_host_port_stop_remove_and_again() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cri = Cri::start(&env);

    let pod = cri.run_pod(
        "web",
        &[
            "--namespace",
            "shop",
            "--uid",
            "9e1f-web",
            "--port",
            "tcp:20080:80",
        ],
    );
    let ip = assert_pod_ip(&cri, &c, &pod).await;
    let net = network(&c, &pod).await;
    let md = metadata(&net);
    assert_eq!(
        md.get("k8s.pod_name").map(String::as_str),
        Some("web"),
        "{md:?}"
    );
    assert_eq!(
        md.get("k8s.pod_namespace").map(String::as_str),
        Some("shop")
    );
    assert_eq!(md.get("k8s.pod_uid").map(String::as_str), Some("9e1f-web"));
    assert_eq!(
        common::mappings(&net),
        vec![("tcp".to_string(), 80, 20080, "0.0.0.0".to_string())]
    );
    // What containerd sent: kubelet's identity in CNI_ARGS, the mapping
    // with go-cni's untagged (capitalised) keys.
    let sent = cri.cni_cache(&pod);
    let args: Vec<(String, String)> = serde_json::from_value(sent["cniArgs"].clone()).unwrap();
    assert!(
        args.contains(&("K8S_POD_NAME".into(), "web".into())),
        "{args:?}"
    );
    assert_eq!(
        sent["capabilityArgs"]["portMappings"][0]["HostPort"], 20080,
        "{sent}"
    );

    let srv = cri.container(&pod, "srv", SERVE_PONG);
    pong_from_world(&world, 20080);
    let local = world.on_node(|| {
        world::tcp_exchange(
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, 20080),
            b"",
            Duration::from_secs(3),
        )
    });
    assert_eq!(
        local.as_deref(),
        Ok(&b"pong\n"[..]),
        "from the node's 127.0.0.1"
    );
    // Inside: the fixed container address; the node's services at the
    // gateway; the world through SNAT.
    let (code, out, err) = cri.exec(&srv, "ip -4 -o addr show dev eth0");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("169.254.68.6/30"), "{out}");
    let node_srv = Server::tcp(
        &env.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 20090),
        b"node:",
    );
    let world_srv = world.tcp_server(20091);
    let (code, out, err) = cri.exec(
        &srv,
        &format!(
            "echo a | nc 169.254.68.5 20090; echo; echo b | nc {} {}",
            world_srv.ip(),
            world_srv.port()
        ),
    );
    assert_eq!((code, out.as_str()), (0, "node:a\n\nworld:b\n"), "{err}");
    drop(node_srv);
    assert_eq!(
        world.peers(20091)[0].ip(),
        std::net::IpAddr::V4(NODE_IP),
        "SNAT to the uplink"
    );

    // (b) Stop releases the network (CNI DEL), Remove succeeds.
    cri.ok(&["stop-pod", &pod]);
    assert!(c.list().await.is_empty(), "StopPodSandbox released it");
    assert_eq!(cri.pod_status(&pod)["state"], "SANDBOX_NOTREADY");
    assert!(env.cni_veths().is_empty(), "{:?}", env.cni_veths());
    assert!(
        world
            .tcp_connect(World::node_addr(20080), b"", Duration::from_secs(1))
            .is_err(),
        "the host port is closed"
    );
    cri.ok(&["rm-pod", &pod]);
    assert_eq!(cri.ok(&["pods"])["items"], serde_json::json!([]));

    // (c) Kubelet's next attempt of the same pod, same host port.
    let again = cri.run_pod(
        "web",
        &[
            "--namespace",
            "shop",
            "--uid",
            "9e1f-web",
            "--attempt",
            "1",
            "--port",
            "tcp:20080:80",
        ],
    );
    assert_ne!(again, pod);
    let ip2 = assert_pod_ip(&cri, &c, &again).await;
    eprintln!("pod IPs: attempt 0 {ip}, attempt 1 {ip2}");
    cri.container(&again, "srv", SERVE_PONG);
    pong_from_world(&world, 20080);
    cri.stop_and_remove(&again);
    assert!(c.list().await.is_empty());
}

/// (d) Three pods at once (kubelet runs sandboxes in parallel): three
/// distinct pod IPs, each its network's sandbox address, each pod
/// reaching the world; all released again, in parallel too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_pods_at_once_get_three_addresses() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cri = std::sync::Arc::new(Cri::start(&env));
    let world_srv = world.tcp_server(0);
    let pods: Vec<String> = (0..3)
        .map(|i| {
            let cri = cri.clone();
            std::thread::spawn(move || cri.run_pod(&format!("p{i}"), &["--uid", &format!("u{i}")]))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let mut ips = std::collections::BTreeSet::new();
    for pod in &pods {
        ips.insert(assert_pod_ip(&cri, &c, pod).await);
    }
    assert_eq!(ips.len(), 3, "distinct pod IPs: {ips:?}");
    assert_eq!(c.list().await.len(), 3);
    for (i, pod) in pods.iter().enumerate() {
        let cid = cri.container(pod, "app", "sleep 100000");
        let (code, out, err) = cri.exec(
            &cid,
            &format!("echo p{i} | nc {} {}", world_srv.ip(), world_srv.port()),
        );
        assert_eq!(code, 0, "{err}");
        assert_eq!(out, format!("world:p{i}\n"));
    }
    let stops: Vec<_> = pods
        .iter()
        .map(|pod| {
            let (cri, pod) = (cri.clone(), pod.clone());
            std::thread::spawn(move || cri.stop_and_remove(&pod))
        })
        .collect();
    for t in stops {
        t.join().unwrap();
    }
    assert!(c.list().await.is_empty());
    assert!(env.cni_veths().is_empty(), "{:?}", env.cni_veths());
}

/// Accepts one connection in the world on `port` and reads it to EOF:
/// (bytes, seconds from the first byte to the end).
fn receive_once(world: &World, port: u16) -> std::thread::JoinHandle<(usize, f64)> {
    let l = in_netns(&world.ns, move || {
        TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))
    })
    .unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let (mut got, mut first, mut buf) = (0usize, None, vec![0u8; 65536]);
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    first.get_or_insert_with(Instant::now);
                    got += n;
                }
                Err(e) => panic!("world receiver after {got} bytes: {e}"),
            }
        }
        let secs = first.map_or(0.0, |f: Instant| f.elapsed().as_secs_f64());
        (got, secs)
    })
}

/// (e) The bandwidth annotations: containerd sends go-cni's capitalised
/// keys with the "unset" burst 2^32-1; the network gets the 10 Mbit/s
/// limits with the default burst (64 KiB), and a 4 MB transfer from the
/// pod to the world takes 4 MB * 8 / 10 Mbit/s = 3.2 s (within 20 %:
/// headers count against the limit). Then Stop and Remove succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_annotations_shape_the_pod() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cri = Cri::start(&env);
    let pod = cri.run_pod(
        "bw",
        &[
            "--annotation",
            "kubernetes.io/ingress-bandwidth=10M",
            "--annotation",
            "kubernetes.io/egress-bandwidth=10M",
        ],
    );
    let sent = cri.cni_cache(&pod);
    assert_eq!(
        sent["capabilityArgs"]["bandwidth"],
        serde_json::json!({"IngressRate": 10_000_000u64, "IngressBurst": 4_294_967_295u64,
            "EgressRate": 10_000_000u64, "EgressBurst": 4_294_967_295u64}),
        "what containerd 1.6 sends"
    );
    assert_pod_ip(&cri, &c, &pod).await;
    let net = network(&c, &pod).await;
    assert_eq!(
        [
            num(&net, "ingress_bps"),
            num(&net, "ingress_burst"),
            num(&net, "egress_bps"),
            num(&net, "egress_burst")
        ],
        [10_000_000, 65_536, 10_000_000, 65_536]
    );
    let cid = cri.container(&pod, "tx", "sleep 100000");
    let rx = receive_once(&world, 20100);
    let started = Instant::now();
    let (code, _, err) = cri.exec(
        &cid,
        &format!("dd if=/dev/zero bs=4000 count=1000 2>/dev/null | nc {WORLD_IP} 20100"),
    );
    assert_eq!(code, 0, "{err}");
    let (got, secs) = rx.join().unwrap();
    eprintln!(
        "4 MB pod -> world at 10 Mbit/s: {secs:.2} s at the receiver ({:.2} s for the exec)",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(got, 4_000_000);
    assert!(
        (2.56..=3.84).contains(&secs),
        "{secs:.2} s, want 3.2 s +- 20 %"
    );
    cri.stop_and_remove(&pod);
    assert!(c.list().await.is_empty());
}

/// (f) A pod's connections to the node's own addresses (the uplink's,
/// cube-dev's) and to another pod's address stay on the node: dropped and
/// counted (`node_addr_drop`), nothing of them reaches the far side of the
/// uplink. Hairpin to a hostPort at the node's uplink address reaches the
/// mapped pod (`hairpin`).
///
/// Needs the datapath of issue 51 item 3 (`node_addrs`, 885a5b6): the
/// build before it SNATed these connections out of the uplink (the world
/// saw 198.51.100.1 -> 198.51.100.1:20081 and -> 192.168.0.x) and the
/// hairpin got no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_traffic_to_node_addresses_stays_on_the_node() {
    require_root!();
    let (env, world) = world::node(&[]);
    let c = env.client().await;
    let cri = Cri::start(&env);
    let web = cri.run_pod("web", &["--port", "tcp:20081:80"]);
    cri.container(&web, "srv", SERVE_PONG);
    pong_from_world(&world, 20081);
    let web_ip = s(&network(&c, &web).await, "sandbox_ip");
    let probe = cri.run_pod("probe", &[]);
    let cid = cri.container(&probe, "probe", "sleep 100000");
    let cube_dev = env
        .ns_cmd(&["ip", "-4", "-o", "addr", "show", "dev", "cube-dev"])
        .split_whitespace()
        .nth(3)
        .and_then(|a| a.split('/').next())
        .expect("cube-dev's address")
        .to_owned();

    // Every IPv4 packet the far side of the uplink receives that is not
    // addressed to the world itself: meant for the node or a pod.
    let cap = world::Capture::start(&world, &env.dir, &format!("ip and not dst host {WORLD_IP}"));
    let try_connect = |dst: &str, port: u16| {
        let (_, out, _) = cri.exec(
            &cid,
            &format!("echo x | timeout 1 nc {dst} {port}; echo \" rc=$?\""),
        );
        out
    };
    let hairpin = try_connect(&NODE_IP.to_string(), 20081);
    let others = [
        (NODE_IP.to_string(), 22),
        (cube_dev.clone(), 80),
        (web_ip.clone(), 80),
    ]
    .map(|(dst, port)| format!("{dst}:{port} -> {:?}", try_connect(&dst, port)));
    // The capture's control: a pod's connection to an address beyond the
    // world does cross the uplink (SNAT), and is all that does.
    try_connect("203.0.113.9", 80);
    let seen = cap.stop();
    eprintln!("probes: hairpin {hairpin:?}, {others:?}");
    let leaked: Vec<&str> = seen
        .lines()
        .filter(|l| !l.contains(" > 203.0.113.9.80:"))
        .collect();
    assert!(
        leaked.is_empty(),
        "pod -> node addresses reached the world:\n{}\n(probes: {others:?})",
        leaked.join("\n")
    );
    assert!(
        seen.contains(&format!("IP {NODE_IP}.")) && seen.contains(" > 203.0.113.9.80:"),
        "the capture saw the control connection: {seen:?}"
    );
    assert!(
        hairpin.starts_with("pong\n"),
        "hairpin to {NODE_IP}:20081: {hairpin:?}"
    );
    // Dropped and counted, not just lost; the hairpin counted too.
    let (_, checks) = c.health().await;
    let (dropped, turned) = (
        world::counter(&checks, "node_addr_drop"),
        world::counter(&checks, "hairpin"),
    );
    assert!(
        dropped >= 3 && turned >= 1,
        "node_addr_drop {dropped}, hairpin {turned}"
    );
    for pod in [&web, &probe] {
        cri.stop_and_remove(pod);
    }
    assert!(c.list().await.is_empty());
}
