//! Metrics through real clients: `cubenetctl metrics` parsed by Prometheus'
//! own OpenMetrics parser (Debian's python3-prometheus-client), the
//! `io.systemd.Metrics` interface through the reference varlink client
//! (PyPI `varlink`, which checks our IDL and every reply against it), both
//! equal to GetNetwork's `traffic`; a local user who may not read gets
//! nothing; the node_exporter textfile is rewritten atomically, 0640.

mod common;

use std::net::SocketAddrV4;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::guest::{GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, udp_frame};
use common::world;
use common::{Env, opts};
use serde_json::Value;

/// Where scripts/deps.sh puts the reference varlink client.
const VARLINK_PYTHON: &str = "/opt/cube-network-agent-test/venv/bin/python";

fn report(env: &Env) -> PathBuf {
    env.dir.join("report/org.cube.NetworkAgent")
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/metrics")
        .join(name)
}

/// OpenMetrics text → [(family, type, sample name, labels, value)] by the
/// prometheus_client parser (which rejects anything not OpenMetrics).
fn parse_openmetrics(text: &str) -> Vec<Value> {
    let code = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for f in text_string_to_metric_families(sys.stdin.read()):
    for s in f.samples:
        out.append({"family": f.name, "type": f.type, "unit": f.unit,
                    "name": s.name, "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", code])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (apt-get install python3-prometheus-client)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the text: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn cubenetctl(env: &Env, uid: Option<u32>) -> std::process::Output {
    let bin = env!("CARGO_BIN_EXE_cubenetctl");
    let mut cmd = match uid {
        None => Command::new(bin),
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                bin,
            ]);
            c
        }
    };
    cmd.arg("metrics")
        .env("CUBENETCTL_REPORT", report(env))
        .output()
        .unwrap()
}

/// GetNetwork's `traffic` over D-Bus.
async fn traffic(c: &common::Client, id: &str) -> std::collections::BTreeMap<String, u64> {
    c.traffic(id).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openmetrics_and_io_systemd_metrics_agree_with_getnetwork() {
    require_root!();
    let textfile = std::env::temp_dir().join(format!("cna-metrics-{}.prom", std::process::id()));
    let _ = std::fs::remove_file(&textfile);
    let tf = textfile.to_str().unwrap().to_owned();
    let (env, world) = world::node(&["--metrics-textfile", &tf, "--metrics-interval", "1"]);
    let c = env.client().await;
    let echo = world.udp_echo(0);
    c.ensure("m-busy", opts(vec![])).await.unwrap();
    // m-idle is a clone of m-busy, paused (both counted below).
    c.ensure(
        "m-idle",
        opts(vec![
            ("clone_of", zbus::zvariant::Value::from("m-busy")),
            ("paused", zbus::zvariant::Value::from(true)),
        ]),
    )
    .await
    .unwrap();
    // A VMM restores a snapshot onto the clone (twice: counted once).
    drop(c.open_tap("m-idle").await.unwrap());
    drop(c.open_tap("m-idle").await.unwrap());
    let guest = RawGuest::new(c.open_tap("m-busy").await.unwrap());
    for i in 0..5u8 {
        let f = udp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            SocketAddrV4::new(GUEST_IP, 41000),
            echo,
            &[i; 64],
        );
        guest.send(&f).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = 0;
    while got < 5 && Instant::now() < deadline {
        got += guest.recv(Duration::from_millis(200)).len();
    }
    assert!(got >= 5, "echoes: {got}");
    let t = traffic(&c, "m-busy").await;
    assert!(t["tx_packets"] == 5 && t["rx_packets"] >= 5, "{t:?}");

    // OpenMetrics through Prometheus' parser.
    let out = cubenetctl(&env, None);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.ends_with("# EOF\n"));
    let samples = parse_openmetrics(&text);
    let find = |name: &str, labels: &[(&str, &str)]| -> f64 {
        samples
            .iter()
            .find(|s| s["name"] == name && labels.iter().all(|(k, v)| s["labels"][*k] == *v))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))["value"]
            .as_f64()
            .unwrap()
    };
    let bytes = "cube_network_agent_sandbox_bytes_total";
    let packets = "cube_network_agent_sandbox_packets_total";
    assert_eq!(
        find(bytes, &[("sandbox_id", "m-busy"), ("direction", "tx")]),
        t["tx_bytes"] as f64
    );
    assert_eq!(
        find(packets, &[("sandbox_id", "m-busy"), ("direction", "tx")]),
        5.0
    );
    assert!(find(bytes, &[("sandbox_id", "m-busy"), ("direction", "rx")]) >= t["rx_bytes"] as f64);
    assert_eq!(
        find(bytes, &[("sandbox_id", "m-idle"), ("direction", "tx")]),
        0.0
    );
    assert_eq!(t["new_flows_snat"], 1, "{t:?}");
    assert_eq!(
        find(
            "cube_network_agent_sandbox_new_flows_total",
            &[("sandbox_id", "m-busy"), ("kind", "snat")]
        ),
        1.0
    );
    // Sparse families carry only values above 0: nothing was dropped.
    assert!(
        !samples
            .iter()
            .any(|s| s["name"] == "cube_network_agent_sandbox_drops_total"),
        "{text}"
    );
    for sparse in ["sandbox_drops", "sandbox_device_drops"] {
        assert!(
            text.contains(&format!("# TYPE cube_network_agent_{sparse} counter\n")),
            "{sparse}"
        );
    }
    assert_eq!(find("cube_network_agent_networks", &[]), 2.0);
    assert_eq!(find("cube_network_agent_cloned_networks", &[]), 1.0);
    assert_eq!(find("cube_network_agent_paused_networks", &[]), 1.0);
    assert_eq!(find("cube_network_agent_clones_restored_total", &[]), 1.0);
    assert_eq!(
        find("cube_network_agent_traffic_while_paused_total", &[]),
        0.0
    );
    assert_eq!(find("cube_network_agent_networks_cloned_total", &[]), 1.0);
    assert_eq!(find("cube_network_agent_healthy", &[]), 1.0);
    assert_eq!(
        find("cube_network_agent_ensure_network_seconds_count", &[]),
        2.0
    );
    assert!(
        find(
            "cube_network_agent_datapath_events_total",
            &[("event", "snat")]
        ) >= 5.0
    );
    let families: std::collections::BTreeSet<(String, String)> = samples
        .iter()
        .map(|s| {
            (
                s["family"].as_str().unwrap().to_owned(),
                s["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (f, kind) in [
        ("cube_network_agent_sandbox_bytes", "counter"),
        ("cube_network_agent_sandbox_flows", "gauge"),
        ("cube_network_agent_sandbox_new_flows", "counter"),
        ("cube_network_agent_flow_table_capacity", "gauge"),
        ("cube_network_agent_release_network_seconds", "histogram"),
        ("cube_network_agent_build", "info"),
    ] {
        assert!(
            families.contains(&(f.into(), kind.into())),
            "{f} {kind}: {families:?}"
        );
    }

    // io.systemd.Metrics through the reference varlink client.
    let out = Command::new(VARLINK_PYTHON)
        .arg(script("varlink_metrics.py"))
        .arg(report(&env))
        .output()
        .expect("the varlink client (scripts/deps.sh --test installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let interfaces = v["info"]["interfaces"].as_array().unwrap();
    assert!(
        interfaces.contains(&Value::from("io.systemd.Metrics")),
        "{v}"
    );
    let described: std::collections::HashMap<&str, &str> = v["describe"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["name"].as_str().unwrap(), d["type"].as_str().unwrap()))
        .collect();
    for m in v["list"].as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        assert!(name.starts_with("org.cube.NetworkAgent."), "{m}");
        assert!(
            described.contains_key(name),
            "{name} listed but not described"
        );
    }
    assert_eq!(described["org.cube.NetworkAgent.sandbox_bytes"], "counter");
    assert_eq!(described["org.cube.NetworkAgent.networks"], "gauge");
    assert_eq!(described["org.cube.NetworkAgent.build"], "string");
    let tx = v["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| {
            m["name"] == "org.cube.NetworkAgent.sandbox_bytes"
                && m["object"] == "m-busy"
                && m["fields"]["direction"] == "tx"
        })
        .unwrap_or_else(|| panic!("no tx bytes of m-busy: {v}"));
    assert_eq!(tx["value"].as_u64(), Some(t["tx_bytes"]));

    // `cubenetctl top`: the sandbox sending now comes first, with a rate.
    let sender = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_millis(1500);
        let mut n = 0u32;
        while Instant::now() < until {
            let f = udp_frame(
                GUEST_MAC,
                GATEWAY_MAC,
                SocketAddrV4::new(GUEST_IP, 41000),
                echo,
                &[7; 500],
            );
            guest.send(&f).unwrap();
            let _ = guest.recv(Duration::from_millis(10));
            n += 1;
        }
        n
    });
    let top = Command::new(env!("CARGO_BIN_EXE_cubenetctl"))
        .args(["top", "--interval=1", "--count=1"])
        .env("CUBENETCTL_REPORT", report(&env))
        .output()
        .unwrap();
    let sent = sender.join().unwrap();
    assert!(top.status.success(), "{top:?}");
    let text = String::from_utf8_lossy(&top.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("SANDBOX") && lines[0].contains("TX/s"),
        "{text}"
    );
    assert!(lines[1].starts_with("m-busy "), "busiest first: {text}");
    assert!(lines[2].starts_with("m-idle "), "{text}");
    assert!(
        lines[1].contains("KB"),
        "a rate of kilobytes per second ({sent} frames): {text}"
    );
    assert!(lines[3].starts_with("2 sandboxes, rates over 1."), "{text}");

    // A local user who may not read (no polkit grant) learns nothing.
    let out = cubenetctl(&env, Some(65534));
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !all.contains("m-busy") && all.contains("AccessDenied"),
        "{all}"
    );

    // A local user holding many connections to the socket does not lock
    // root (systemd-report) out.
    let mut hog = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
        ])
        .arg(
            "import socket, sys, time\n\
             held = []\n\
             for _ in range(100):\n\
             \x20   s = socket.socket(socket.AF_UNIX)\n\
             \x20   s.connect(sys.argv[1])\n\
             \x20   held.append(s)\n\
             print('held', flush=True)\n\
             time.sleep(60)\n",
        )
        .arg(report(&env))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(hog.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "held");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let out = cubenetctl(&env, None);
    let _ = hog.kill();
    let _ = hog.wait();
    assert!(
        out.status.success(),
        "root refused while a user holds connections: {out:?}"
    );

    // The textfile: rewritten every second, atomically, 0640, parseable.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(t) = std::fs::read_to_string(&textfile)
            && t.contains("sandbox_id=\"m-busy\"")
        {
            let samples = parse_openmetrics(&t);
            assert!(samples.iter().any(|s| s["name"] == bytes), "{t}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no textfile at {}",
            textfile.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mode = std::fs::metadata(&textfile).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o640,
        "the textfile names every sandbox: not world-readable"
    );
    c.release("m-idle").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(&textfile)
        .unwrap_or_default()
        .contains("sandbox_id=\"m-idle\"")
    {
        assert!(Instant::now() < deadline, "the textfile is not rewritten");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_file(&textfile);
}
