//! End-to-end tests of `cubenetctl`: the real binary against the real agent
//! (in its own network namespace, on a private bus, varlink on its socket;
//! root only), plus its help, man page and shell completions (no root
//! needed).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Env;
use serde_json::{Value, json};

const CTL: &str = env!("CARGO_BIN_EXE_cubenetctl");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// `cubenetctl` with a clean environment: no CUBENETCTL_*, a UTF-8 locale
/// unless `envs` says otherwise.
fn command(envs: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(CTL);
    for k in ["CUBENETCTL_BUS", "CUBENETCTL_VARLINK", "LC_ALL", "LC_CTYPE"] {
        cmd.env_remove(k);
    }
    cmd.env("LANG", "C.UTF-8");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `cubenetctl --bus ADDRESS ARGS...` (no `--bus` if `address` is None)
/// with extra environment variables.
fn ctl_env(address: Option<&str>, envs: &[(&str, &str)], args: &[&str]) -> Out {
    let mut cmd = command(envs);
    if let Some(a) = address {
        cmd.args(["--bus", a]);
    }
    let out = cmd.args(args).output().expect("running cubenetctl");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ctl(address: Option<&str>, args: &[&str]) -> Out {
    ctl_env(address, &[], args)
}

fn json(o: &Out) -> Value {
    serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {o:?}"))
}

/// A GetNetwork answer (`status`) without its `traffic` counters (which
/// only GetNetwork has), checked present.
fn without_traffic(mut v: Value) -> Value {
    let t = v.as_object_mut().and_then(|o| o.remove("traffic"));
    assert!(
        t.as_ref().is_some_and(|t| t["tx_bytes"].is_u64()),
        "traffic: {t:?}"
    );
    v
}

/// Every stderr line says it comes from cubenetctl.
fn assert_prefixed(o: &Out) {
    assert!(!o.stderr.is_empty(), "no error printed: {o:?}");
    for l in o.stderr.lines() {
        assert!(
            l.starts_with("cubenetctl: "),
            "unprefixed line {l:?}: {o:?}"
        );
    }
}

fn varlink_path(env: &Env) -> PathBuf {
    env.dir.join("run").join("org.cube.NetworkAgent")
}

/// One varlink call on the agent's socket: the reply's parameters, or
/// `Err((error name, parameters))`.
fn varlink(env: &Env, method: &str, params: Value) -> Result<Value, (String, Value)> {
    let path = varlink_path(env);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sock = loop {
        match UnixStream::connect(&path) {
            Ok(s) => break s,
            Err(e) => {
                assert!(Instant::now() < deadline, "connecting {path:?}: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let msg = json!({"method": format!("org.cube.NetworkAgent.{method}"), "parameters": params});
    let mut bytes = serde_json::to_vec(&msg).unwrap();
    bytes.push(0);
    sock.write_all(&bytes).unwrap();
    let mut buf = vec![];
    let mut chunk = [0u8; 65536];
    let end = loop {
        if let Some(p) = buf.iter().position(|&b| b == 0) {
            break p;
        }
        let n = sock.read(&mut chunk).unwrap();
        assert!(n > 0, "{method}: connection closed without a reply");
        buf.extend_from_slice(&chunk[..n]);
    };
    let reply: Value = serde_json::from_slice(&buf[..end]).unwrap();
    match reply.get("error") {
        Some(e) => Err((e.as_str().unwrap().to_owned(), reply["parameters"].clone())),
        None => Ok(reply["parameters"].clone()),
    }
}

#[test]
fn ensure_list_status_converge_release() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());

    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-1",
            "--port",
            "tcp:80",
            "--port=udp:53:25053",
            "--deny-out",
            "10.0.0.0/8",
            "--metadata",
            "owner=team-a",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("Sandbox: sbx-1"), "{o:?}");
    assert!(o.stdout.contains("udp 53 → 25053"), "{o:?}");
    assert!(o.stdout.contains("10.0.0.0/8"), "{o:?}");
    assert!(o.stdout.contains("owner=team-a"), "{o:?}");

    // list --json: one entry with the agent's fields, structures named.
    let o = ctl(bus, &["list", "--json"]);
    assert_eq!(o.code, 0, "{o:?}");
    let v = json(&o);
    let nets = v.as_array().expect("an array");
    assert_eq!(nets.len(), 1, "{o:?}");
    let n = &nets[0];
    assert_eq!(n["sandbox_id"], "sbx-1");
    let ip = n["sandbox_ip"].as_str().unwrap().to_owned();
    assert!(ip.starts_with("192.168."), "{ip}");
    let tap = n["tap_name"].as_str().unwrap().to_owned();
    assert!(tap.starts_with("ctap"), "{tap}");
    assert_eq!(n["mtu"], 1300);
    assert_eq!(n["deny_out"], json!(["10.0.0.0/8"]));
    assert_eq!(n["metadata"], json!({"owner": "team-a"}));
    let pm = n["port_mappings"].as_array().unwrap();
    assert_eq!(pm.len(), 2, "{pm:?}");
    assert_eq!(pm[0]["protocol"], "tcp");
    assert_eq!(pm[0]["container_port"], 80);
    let tcp_host = pm[0]["host_port"].as_u64().unwrap();
    assert!((20000..=29999).contains(&tcp_host), "{pm:?}");
    assert_eq!(
        pm[1],
        json!({"protocol": "udp", "container_port": 53, "host_port": 25053, "host_ip": "0.0.0.0"})
    );
    let routes = n["routes"].as_array().unwrap();
    assert!(!routes.is_empty(), "{n}");
    for r in routes {
        let keys: Vec<&String> = r.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["destination", "device", "gateway"], "{r}");
    }
    for a in n["arp_neighbors"].as_array().unwrap() {
        let keys: Vec<&String> = a.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["device", "ip", "mac"], "{a}");
    }

    // list: the table; PORTS is one token per network.
    let o = ctl(bus, &["list"]);
    assert_eq!(o.code, 0, "{o:?}");
    let lines: Vec<&str> = o.stdout.lines().collect();
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        ["SANDBOX", "SANDBOX-IP", "TAP", "MTU", "PORTS", "CNI"],
        "{o:?}"
    );
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        row,
        [
            "sbx-1",
            ip.as_str(),
            tap.as_str(),
            "1300",
            &format!("tcp:80:{tcp_host},udp:53:25053"),
            "-"
        ],
        "{o:?}"
    );
    assert_eq!(lines.last(), Some(&"1 network."), "{o:?}");
    let o = ctl(bus, &["--no-legend", "list"]);
    assert_eq!(o.stdout.lines().count(), 1, "{o:?}");
    assert!(o.stdout.starts_with("sbx-1 "), "{o:?}");

    // status, human and JSON.
    let o = ctl(bus, &["status", "sbx-1"]);
    assert_eq!(o.code, 0, "{o:?}");
    for want in [
        "Sandbox: sbx-1",
        &format!("Sandbox IP: {ip}"),
        &format!("TAP: {tap}"),
        "MTU: 1300",
        "Guest IP: 169.254.68.6/30",
        "Gateway MAC: 20:90:6f:cf:cf:cf",
        &format!("Ports: tcp 80 → {tcp_host}"),
        "udp 53 → 25053",
        "Internet: yes",
        "Attach: tap",
        "Created: ",
    ] {
        assert!(o.stdout.contains(want), "missing {want:?}: {o:?}");
    }
    // Aligned: every "Key: value" line has its colon in the same column.
    let cols: Vec<usize> = o
        .stdout
        .lines()
        .filter_map(|l| l.find(": "))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(cols.len(), 1, "{o:?}");
    let o = ctl(bus, &["status", "sbx-1", "--json"]);
    assert_eq!(o.code, 0, "{o:?}");
    let s = without_traffic(json(&o));
    assert_eq!(&s, n, "status --json equals the list entry");

    // Converge: a different port, same address and TAP.
    let o = ctl(
        bus,
        &[
            "--json",
            "ensure",
            "sbx-1",
            "--port",
            "tcp:443:24443",
            "--mtu",
            "1400",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let c = json(&o);
    assert_eq!(c["sandbox_ip"], ip.as_str());
    assert_eq!(c["tap_name"], tap.as_str());
    assert_eq!(c["mtu"], 1400);
    assert_eq!(
        c["port_mappings"],
        json!([{"protocol": "tcp", "container_port": 443, "host_port": 24443, "host_ip": "0.0.0.0"}])
    );
    assert_eq!(c["deny_out"], json!([]), "declarative: omitted = default");

    // Reconcile: nothing to repair.
    let o = ctl(bus, &["reconcile"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("Checked: 1"), "{o:?}");
    let o = ctl(bus, &["reconcile", "sbx-1", "--json"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(json(&o)["checked"], 1);

    // Release, then again: exit 3, with the prefix.
    let o = ctl(bus, &["release", "sbx-1"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout, "released sbx-1\n");
    let o = ctl(bus, &["release", "sbx-1"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert_eq!(o.stdout, "", "{o:?}");
    assert_eq!(o.stderr, "cubenetctl: sbx-1: no such network\n", "{o:?}");
    let o = ctl(bus, &["release", "sbx-1", "--json"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert_eq!(json(&o), json!({"sandbox_id": "sbx-1", "released": false}));

    // Missing networks: exit 3 with the agent's NotFound.
    let o = ctl(bus, &["status", "sbx-1"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert!(o.stderr.starts_with("cubenetctl: NotFound: "), "{o:?}");
    assert!(o.stderr.contains("sbx-1"), "{o:?}");
    let o = ctl(bus, &["list"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout.lines().last(), Some("0 networks."), "{o:?}");
    let o = ctl(bus, &["list", "--json"]);
    assert_eq!(json(&o), json!([]));
}

/// A network has one JSON shape on every edge: `cubenetctl status --json`
/// (D-Bus, converted by cubenetctl) equals varlink's GetNetwork answer for
/// the same network, key for key; so do `list --json` and ListNetworks.
#[test]
fn json_network_equals_varlink_network() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());
    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-v",
            "--port=tcp:80",
            "--port=udp:53:25053:127.0.0.1",
            "--allow-out=10.1.0.0/16",
            "--deny-out=10.0.0.0/8",
            "--no-internet",
            "--metadata=owner=team-a",
            "--metadata=tier=gold",
            "--idempotency-key=req-1",
            "--mtu=1400",
            "--json",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let ensured = json(&o);
    // sbx-w: a clone of sbx-v (its mappings on host ports of its own).
    assert_eq!(ctl(bus, &["ensure", "sbx-w", "--clone-of=sbx-v"]).code, 0);

    let o = ctl(bus, &["status", "sbx-v", "--json"]);
    assert_eq!(o.code, 0, "{o:?}");
    let dbus = json(&o);
    let vl =
        varlink(&env, "GetNetwork", json!({"sandbox_id": "sbx-v"})).unwrap()["network"].clone();
    assert_eq!(
        dbus.as_object().unwrap().keys().collect::<Vec<_>>(),
        vl.as_object().unwrap().keys().collect::<Vec<_>>(),
        "the same keys"
    );
    let (dbus, vl) = (without_traffic(dbus), without_traffic(vl));
    assert_eq!(dbus, vl, "status --json == varlink GetNetwork");
    assert_eq!(ensured, vl, "ensure --json == varlink GetNetwork");
    // Every structure is populated, so the comparison covers their names.
    for k in ["port_mappings", "routes", "arp_neighbors"] {
        assert!(vl[k].as_array().is_some_and(|a| !a.is_empty()), "{k}: {vl}");
    }
    assert_eq!(vl["port_mappings"][1]["host_ip"], "127.0.0.1");
    assert_eq!(vl["idempotency_key"], "req-1");
    assert_eq!(vl["allow_internet_access"], false);
    let w = json(&ctl(bus, &["status", "sbx-w", "--json"]));
    let vw =
        varlink(&env, "GetNetwork", json!({"sandbox_id": "sbx-w"})).unwrap()["network"].clone();
    assert_eq!(without_traffic(w), without_traffic(vw.clone()));
    assert_eq!(vw["cloned_from"], "sbx-v");
    assert_eq!(vw["deny_out"], vl["deny_out"]);
    assert_ne!(
        vw["port_mappings"][0]["host_port"],
        vl["port_mappings"][0]["host_port"]
    );
    let human = ctl(bus, &["status", "sbx-w"]);
    assert!(
        human.stdout.contains("Cloned from") && human.stdout.contains("sbx-v"),
        "{human:?}"
    );
    // What may not come with --clone-of is named by the flags typed, not
    // by the wire's keys.
    for (flag, typed) in [("--mtu", "--mtu=1400"), ("--port", "--port=tcp:81")] {
        let o = ctl(bus, &["ensure", "sbx-x", "--clone-of=sbx-v", typed]);
        assert!(
            o.code != 0
                && o.stderr.contains("--clone-of sbx-v (clone_of)")
                && o.stderr.contains(&format!("(got {flag})"))
                && o.stderr
                    .contains("only --metadata, --idempotency-key and --paused")
                && !o.stderr.contains("port_mappings")
                && !o.stderr.contains("idempotency_key"),
            "{o:?}"
        );
    }

    let o = ctl(bus, &["list", "--json"]);
    let mut all = varlink(&env, "ListNetworks", json!({})).unwrap()["networks"]
        .as_array()
        .unwrap()
        .clone();
    all.sort_by_key(|n| n["sandbox_id"].as_str().unwrap().to_owned());
    assert_eq!(json(&o), Value::Array(all), "list --json == ListNetworks");
}

#[test]
fn errors_name_the_flag_and_have_distinct_exit_codes() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());

    // Usage errors: exit 2, the message names the flag; nothing is called.
    for (args, want) in [
        (
            &["ensure", "sbx-e", "--port", "tcp:80:x"][..],
            "cubenetctl: --port tcp:80:x: host port 'x' is not a number",
        ),
        (
            &["ensure", "sbx-e", "--port", "tcp:70000"],
            "cubenetctl: --port tcp:70000: container port 70000 is out of range (1-65535)",
        ),
        (
            &["ensure", "sbx-e", "--port", "tcp:0"],
            "cubenetctl: --port tcp:0: container port 0 is out of range (1-65535)",
        ),
        (
            &["ensure", "sbx-e", "--port=udp:53:65536"],
            "cubenetctl: --port udp:53:65536: host port 65536 is out of range (0-65535)",
        ),
        (
            &["ensure", "sbx-e", "--mtu", "big"],
            "cubenetctl: --mtu 'big' is not a number",
        ),
        (&["-x"], "cubenetctl: unknown option '-x'"),
        (
            &["--json=long"],
            "cubenetctl: --json=long: expected pretty, short or off",
        ),
    ] {
        let o = ctl(bus, args);
        assert_eq!(o.code, 2, "{args:?}: {o:?}");
        assert!(o.stderr.starts_with(want), "{args:?}: {o:?}");
        assert!(o.stderr.contains("'cubenetctl --help'"), "{o:?}");
    }
    for bad in [
        &["ensure", "sbx-e", "--port", "sctp:80"][..],
        &["ensure", "sbx-e", "--metadata", "novalue"],
        &["ensure", "sbx-e", "--port"],
        &["status"],
        &["status", "a", "b"],
        &["frobnicate"],
        &["list", "--bogus"],
        &["list", "--port=tcp:80"],
        &["open-tap", "sbx-e"],
        &["watch", "extra"],
        &["ensure", "-bad-id"],
    ] {
        let o = ctl(bus, bad);
        assert_eq!(o.code, 2, "{bad:?}: {o:?}");
        assert_prefixed(&o);
    }
    assert_eq!(ctl(bus, &["list", "--json"]).stdout.trim(), "[]");

    // Agent-side validation: exit 1 with the D-Bus error's short name, and
    // the agent's option key turned into the flag that was typed.
    let o = ctl(bus, &["ensure", "sbx-e", "--mtu", "50"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr
            .starts_with("cubenetctl: InvalidArgument: --mtu 50 (mtu): 50 is out of range"),
        "{o:?}"
    );
    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-e",
            "--port",
            "tcp:80:24080",
            "--port",
            "tcp:81:24080",
        ],
    );
    assert_eq!(o.code, 1, "{o:?}");
    assert_eq!(
        o.stderr.trim_end(),
        "cubenetctl: InvalidArgument: --port tcp:81:24080 (port_mappings[1]): tcp host port \
         24080 is also used by --port tcp:80:24080 (port_mappings[0])",
        "{o:?}"
    );
    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-e",
            "--port=tcp:80",
            "--port=tcp:81:0:10.9.9.9",
        ],
    );
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr.starts_with(
            "cubenetctl: InvalidArgument: --port tcp:81:0:10.9.9.9 (port_mappings[1]): \
             host_ip 10.9.9.9 is not an address of this node"
        ),
        "{o:?}"
    );
    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-e",
            "--deny-out=10.0.0.0/8",
            "--deny-out",
            "nope",
        ],
    );
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr
            .starts_with("cubenetctl: InvalidArgument: --deny-out nope (deny_out[1]): "),
        "{o:?}"
    );
    let o = ctl(bus, &["ensure", "sbx-e", "--allow-out", "10.0.0.1/8"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr
            .starts_with("cubenetctl: InvalidArgument: --allow-out 10.0.0.1/8 (allow_out[0]): "),
        "{o:?}"
    );
    let o = ctl(bus, &["ensure", "bad/id"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr
            .starts_with("cubenetctl: InvalidArgument: sandbox_id: "),
        "{o:?}"
    );
    assert_eq!(ctl(bus, &["list", "--json"]).stdout.trim(), "[]");

    // Health: the test namespace has no uplink, so degraded.
    let o = ctl(bus, &["health"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(o.stdout.starts_with("CHECK"), "{o:?}");
    assert!(o.stdout.lines().any(|l| l.starts_with("uplink ")), "{o:?}");
    assert_eq!(o.stdout.lines().last(), Some("degraded"), "{o:?}");
    let o = ctl(bus, &["health", "--json"]);
    assert_eq!(o.code, 1, "{o:?}");
    let h = json(&o);
    assert_eq!(h["healthy"], false);
    assert!(
        h["checks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["name"] == "uplink" && c["ok"] == false),
        "{h}"
    );

    // The bus from the environment works too.
    let o = command(&[("CUBENETCTL_BUS", &env.address)])
        .args(["list", "--no-legend"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
}

/// -q, -j, --no-legend, plurals and the ASCII locale.
#[test]
fn quiet_json_legend_plurals_and_ascii() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());
    let list_summary = |o: &Out| o.stdout.lines().last().unwrap_or("").to_owned();

    assert_eq!(list_summary(&ctl(bus, &["list"])), "0 networks.");
    assert_eq!(ctl(bus, &["ensure", "sbx-a", "--port=tcp:80"]).code, 0);
    assert_eq!(list_summary(&ctl(bus, &["list"])), "1 network.");
    assert_eq!(
        ctl(
            bus,
            &[
                "ensure",
                "sbx-b",
                "--port=tcp:80",
                "--port=udp:53:25053:127.0.0.1",
                "--metadata=note=a b→c",
            ]
        )
        .code,
        0
    );
    let o = ctl(bus, &["list"]);
    assert_eq!(list_summary(&o), "2 networks.", "{o:?}");

    // --no-legend: exactly the rows, six whitespace-separated fields each.
    let o = ctl(bus, &["list", "--no-legend"]);
    assert_eq!(o.code, 0, "{o:?}");
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{o:?}");
    for l in &lines {
        assert_eq!(l.split_whitespace().count(), 6, "{l:?}: {o:?}");
    }
    let b: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(b[0], "sbx-b");
    assert!(b[4].starts_with("tcp:80:"), "{o:?}");
    assert!(b[4].ends_with(",udp:53:25053:127.0.0.1"), "{o:?}");

    // -q: no informational lines; the rows and errors stay.
    let o = ctl(bus, &["-q", "list"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(!o.stdout.contains("networks."), "{o:?}");
    assert!(o.stdout.starts_with("SANDBOX"), "{o:?}");
    assert_eq!(o.stdout.lines().count(), 3, "{o:?}");
    let o = ctl(bus, &["list", "--no-legend", "-q"]);
    assert_eq!(o.stdout.lines().count(), 2, "{o:?}");
    // health -q: only the failing checks, no header and no summary.
    let o = ctl(bus, &["health", "--quiet"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(!o.stdout.contains("degraded"), "{o:?}");
    assert!(!o.stdout.contains("CHECK"), "{o:?}");
    assert!(!o.stdout.is_empty(), "{o:?}");
    assert!(
        o.stdout
            .lines()
            .all(|l| l.split_whitespace().nth(1) == Some("no")),
        "{o:?}"
    );
    // ensure -q: nothing (the exit status says it worked); with --json the
    // network all the same.
    let o = ctl(bus, &["-q", "ensure", "sbx-q", "--port=tcp:80"]);
    assert_eq!((o.code, o.stdout.as_str(), o.stderr.as_str()), (0, "", ""));
    let o = ctl(bus, &["ensure", "sbx-q", "--port=tcp:80", "-q", "--json"]);
    assert_eq!(json(&o)["sandbox_id"], "sbx-q", "{o:?}");
    let o = ctl(bus, &["ensure", "sbx-q", "--mtu=50", "--quiet"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stdout.is_empty() && o.stderr.contains("--mtu 50"),
        "{o:?}"
    );
    assert_eq!(ctl(bus, &["release", "sbx-q"]).code, 0);
    let o = ctl(bus, &["release", "sbx-a", "-q"]);
    assert_eq!((o.code, o.stdout.as_str(), o.stderr.as_str()), (0, "", ""));
    let o = ctl(bus, &["release", "sbx-a", "-q"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert_eq!(o.stderr, "cubenetctl: sbx-a: no such network\n", "{o:?}");
    assert!(o.stdout.is_empty(), "{o:?}");

    // -j: short when stdout is not a terminal, pretty on a terminal.
    let o = ctl(bus, &["-j", "status", "sbx-b"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout.lines().count(), 1, "{o:?}");
    let short = json(&o);
    assert_eq!(short["sandbox_id"], "sbx-b");
    let o = ctl(bus, &["--json=pretty", "status", "sbx-b"]);
    assert!(o.stdout.lines().count() > 10, "{o:?}");
    assert_eq!(json(&o), short);
    let o = ctl(bus, &["--json=off", "status", "sbx-b"]);
    assert!(o.stdout.contains("Sandbox: sbx-b"), "{o:?}");
    let o = Command::new("script")
        .args(["-qec"])
        .arg(format!(
            "env -u LC_ALL LANG=C.UTF-8 {CTL} --bus {} -j status sbx-b",
            env.address
        ))
        .arg("/dev/null")
        .output()
        .expect("script(1) from bsdutils");
    let tty = String::from_utf8_lossy(&o.stdout).replace("\r\n", "\n");
    assert!(tty.lines().count() > 10, "not pretty on a terminal: {tty}");
    assert!(tty.starts_with("{\n  \""), "{tty}");
    let v: Value = serde_json::from_str(&tty).unwrap_or_else(|e| panic!("{e}: {tty}"));
    assert_eq!(v, short);

    // LANG=C (or no locale at all): pure ASCII, no arrow.
    let c = [("LANG", "C")];
    for args in [
        &["list"][..],
        &["list", "--no-legend"],
        &["status", "sbx-b"],
        &["health"],
        &["--help"],
        &["ensure", "--help"],
    ] {
        let o = ctl_env(bus, &c, args);
        assert!(o.code == 0 || args == ["health"], "{args:?}: {o:?}");
        assert!(!o.stdout.is_empty(), "{args:?}");
        assert!(o.stdout.is_ascii(), "{args:?}: not ASCII: {o:?}");
    }
    let o = ctl_env(bus, &c, &["status", "sbx-b"]);
    assert!(o.stdout.contains("tcp 80 -> "), "{o:?}");
    assert!(
        o.stdout.contains("note=a b\\xe2\\x86\\x92c"),
        "non-ASCII escaped: {o:?}"
    );
    let o = ctl_env(
        bus,
        &[("LANG", "en_US.UTF-8"), ("LC_ALL", "POSIX")],
        &["status", "sbx-b"],
    );
    assert!(o.stdout.is_ascii(), "LC_ALL wins: {o:?}");
    let o = command(&[])
        .env_remove("LANG")
        .args(["--bus", &env.address, "status", "sbx-b"])
        .output()
        .unwrap();
    assert!(o.stdout.is_ascii(), "no locale = C");
    assert!(!o.stdout.is_empty());
    // UTF-8: the arrow stays in status, the list stays one token per cell.
    let o = ctl(bus, &["status", "sbx-b"]);
    assert!(o.stdout.contains("tcp 80 → "), "{o:?}");
    assert!(o.stdout.contains("note=a b→c"), "{o:?}");
    let o = ctl(bus, &["list", "--no-legend"]);
    assert!(!o.stdout.contains('→'), "{o:?}");
}

/// Reads a child's stdout lines on a thread, with a timeout per line.
struct Watcher {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Watcher {
    fn start(envs: &[(&str, &str)], args: &[&str]) -> Watcher {
        let mut child = command(envs)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting cubenetctl watch");
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Watcher { child, lines }
    }

    fn next(&mut self) -> String {
        match self.lines.recv_timeout(Duration::from_secs(15)) {
            Ok(l) => l,
            Err(e) => {
                let _ = self.child.kill();
                let mut err = String::new();
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("no line from cubenetctl watch ({e}); stderr: {err}");
            }
        }
    }

    fn next_json(&mut self) -> Value {
        let l = self.next();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("not one JSON object ({e}): {l}"))
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn watch_prints_one_line_per_event() {
    require_root!();
    let mut env = Env::new(&[]);
    let bus = Some(env.address.as_str());
    let sock = varlink_path(&env);
    let sock = sock.to_str().unwrap();
    // The socket exists once the agent serves it.
    varlink(&env, "ListNetworks", json!({})).unwrap();

    // --json: one object per line, the varlink events.
    let mut w = Watcher::start(&[], &["--varlink", sock, "watch", "--json"]);
    let first = w.next_json();
    assert_eq!(first["kind"], "current", "{first}");
    assert_eq!(first["networks"], json!([]), "{first}");
    let o = ctl(bus, &["ensure", "w1", "--port", "tcp:80"]);
    assert_eq!(o.code, 0, "{o:?}");
    let created = w.next_json();
    assert_eq!(
        (&created["kind"], &created["sandbox_id"]),
        (&json!("created"), &json!("w1")),
        "{created}"
    );
    let status = without_traffic(json(&ctl(bus, &["status", "w1", "--json"])));
    assert_eq!(created["network"], status, "one network shape");
    assert_eq!(ctl(bus, &["ensure", "w1", "--port", "tcp:81"]).code, 0);
    let updated = w.next_json();
    assert_eq!(updated["kind"], "updated", "{updated}");
    assert_eq!(updated["network"]["port_mappings"][0]["container_port"], 81);
    assert_eq!(ctl(bus, &["release", "w1"]).code, 0);
    let released = w.next_json();
    assert_eq!(
        (&released["kind"], &released["sandbox_id"]),
        (&json!("released"), &json!("w1")),
        "{released}"
    );
    assert!(released.get("network").is_none(), "{released}");
    let seqs: Vec<u64> = [&first, &created, &updated, &released]
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|p| p[0] < p[1]), "{seqs:?}");
    drop(w);

    // Text, with the socket from $CUBENETCTL_VARLINK: the networks at the
    // start, then one line per change, six fields (SEQ KIND SANDBOX IP TAP PORTS).
    assert_eq!(ctl(bus, &["ensure", "w2", "--port=tcp:80:24080"]).code, 0);
    let n = json(&ctl(bus, &["status", "w2", "--json"]));
    let mut w = Watcher::start(&[("CUBENETCTL_VARLINK", sock)], &["watch"]);
    // A header, as `list` has.
    assert_eq!(w.next(), "SEQ KIND SANDBOX SANDBOX-IP TAP PORTS NOTE");
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(f.len(), 6, "{l}");
    assert_eq!(
        &f[1..],
        [
            "current",
            "w2",
            n["sandbox_ip"].as_str().unwrap(),
            n["tap_name"].as_str().unwrap(),
            "tcp:80:24080"
        ],
        "{l}"
    );
    assert_eq!(ctl(bus, &["ensure", "w3"]).code, 0);
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(
        (f.len(), f[1], f[2], f[5]),
        (6, "created", "w3", "-"),
        "{l}"
    );
    // A pause and a resume say which they are (both are "updated").
    let w2 = ["ensure", "w2", "--port=tcp:80:24080"];
    assert_eq!(ctl(bus, &[&w2[..], &["--paused"]].concat()).code, 0);
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(
        (f[1], f[2], f.get(6)),
        ("updated", "w2", Some(&"paused")),
        "{l}"
    );
    assert_eq!(ctl(bus, &w2).code, 0);
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(
        (f[1], f[2], f.get(6)),
        ("updated", "w2", Some(&"resumed")),
        "{l}"
    );
    assert_eq!(ctl(bus, &["ensure", "w2", "--port=tcp:81:24081"]).code, 0);
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!((f[1], f.len()), ("updated", 6), "neither: no note: {l}");
    assert_eq!(ctl(bus, &["release", "w2"]).code, 0);
    let l = w.next();
    let f: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(&f[1..], ["released", "w2", "-", "-", "-"], "{l}");
    // --no-legend: no header.
    let mut quiet = Watcher::start(&[("CUBENETCTL_VARLINK", sock)], &["watch", "--no-legend"]);
    assert_eq!(ctl(bus, &["ensure", "w4"]).code, 0);
    let l = quiet.next();
    assert!(l.split_whitespace().nth(1) == Some("current"), "{l}");
    drop(quiet);
    assert_eq!(ctl(bus, &["release", "w4"]).code, 0);
    let l = w.next();
    assert!(l.contains(" created w4 "), "{l}");
    let l = w.next();
    assert!(l.contains(" released w4 "), "{l}");

    // The agent stops: the stream ends, exit 1 with a prefixed message.
    env.stop_agent();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = w.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "watch outlived the agent");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(1), "{status:?}");
    let mut err = String::new();
    w.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        err.starts_with("cubenetctl: the agent ended the stream"),
        "{err}"
    );
}

#[test]
fn unreachable_agent_is_exit_4() {
    require_root!();
    let o = ctl(Some("unix:path=/nonexistent"), &["list"]);
    assert_eq!(o.code, 4, "{o:?}");
    assert_prefixed(&o);
    let o = ctl(None, &["--varlink", "/nonexistent/socket", "watch"]);
    assert_eq!(o.code, 4, "{o:?}");
    assert_prefixed(&o);
    assert!(o.stderr.contains("/nonexistent/socket"), "{o:?}");

    // A bus where nobody owns the name.
    let mut env = Env::new(&[]);
    env.stop_agent();
    let o = ctl(Some(&env.address), &["status", "x"]);
    assert_eq!(o.code, 4, "{o:?}");
    assert!(o.stderr.contains("ServiceUnknown"), "{o:?}");
    assert_prefixed(&o);
    env.start_agent();
}

#[test]
fn open_tap_execs_with_the_tap_on_fd_3() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());
    assert_eq!(ctl(bus, &["ensure", "sbx-t"]).code, 0);
    let o = ctl(
        bus,
        &[
            "open-tap",
            "sbx-t",
            "--",
            "sh",
            "-c",
            "readlink /proc/self/fd/3; cat /proc/self/fdinfo/3",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("/dev/net/tun"), "{o:?}");
    // Exactly fd 3 was added; the bus socket did not leak into the command.
    let fds = |o: &[u8]| -> std::collections::BTreeSet<String> {
        String::from_utf8_lossy(o)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let script = "ls /proc/$$/fd";
    let base = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(!fds(&base.stdout).contains("3"), "fd 3 already inherited");
    let o = ctl(bus, &["open-tap", "sbx-t", "--", "sh", "-c", script]);
    assert_eq!(o.code, 0, "{o:?}");
    let added: Vec<String> = fds(o.stdout.as_bytes())
        .difference(&fds(&base.stdout))
        .cloned()
        .collect();
    assert_eq!(added, ["3"], "{o:?}");
    // The command's exit status is cubenetctl's.
    let o = ctl(bus, &["open-tap", "sbx-t", "--", "sh", "-c", "exit 7"]);
    assert_eq!(o.code, 7, "{o:?}");
    let o = ctl(bus, &["open-tap", "sbx-t", "--", "/nonexistent/vmm"]);
    assert_eq!(o.code, 127, "{o:?}");
    assert_prefixed(&o);
    let o = ctl(bus, &["open-tap", "nope", "--", "true"]);
    assert_eq!(o.code, 3, "{o:?}");

    // Several networks (a VM with several NICs): their TAPs on fds 3, 4,
    // 5 in the order given, nothing else added; one unknown id fails the
    // whole call before anything runs.
    let mut taps = vec![];
    for id in ["sbx-u", "sbx-v"] {
        let o = ctl(bus, &["--json", "ensure", id]);
        assert_eq!(o.code, 0, "{o:?}");
        let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
        taps.push(v["tap_name"].as_str().unwrap().to_owned());
    }
    let o = ctl(bus, &["--json", "status", "sbx-t"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let tap_t = v["tap_name"].as_str().unwrap().to_owned();
    let iff =
        "for n in 3 4 5; do sed -n 's/^iff:\\t/'$n' /p' /proc/self/fdinfo/$n; done; ls /proc/$$/fd";
    let o = ctl(
        bus,
        &["open-tap", "sbx-v", "sbx-t", "sbx-u", "--", "sh", "-c", iff],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let want = format!("3 {}\n4 {tap_t}\n5 {}\n", taps[1], taps[0]);
    assert!(o.stdout.starts_with(&want), "{o:?}");
    let added: Vec<String> = fds(o
        .stdout
        .lines()
        .skip(3)
        .collect::<Vec<_>>()
        .join(" ")
        .as_bytes())
    .difference(&fds(&base.stdout))
    .cloned()
    .collect();
    assert_eq!(added, ["3", "4", "5"], "{o:?}");
    let o = ctl(bus, &["open-tap", "sbx-u", "nope", "--", "true"]);
    assert_eq!(o.code, 3, "{o:?}");
}

const COMMANDS: &[&str] = &[
    "metrics",
    "top",
    "list",
    "status",
    "ensure",
    "egress-rules",
    "egress-ca",
    "release",
    "reconcile",
    "health",
    "capacity",
    "open-tap",
    "watch",
    "flows",
];

/// Every `--long-option` a help text names.
fn long_options(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_owned)
        .collect()
}

#[test]
fn help_and_version() {
    let o = ctl(None, &["--help"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("Exit status:"), "{o:?}");
    assert!(o.stdout.contains("See 'man cubenetctl'"), "{o:?}");
    assert!(!o.stdout.contains(".md"), "{o:?}");
    for opt in [
        "-j",
        "-q --quiet",
        "-V --version",
        "--no-pager",
        "--no-legend",
        "--json=pretty|short|off",
        "--varlink=PATH",
        "--bus=BUS",
    ] {
        assert!(o.stdout.contains(opt), "{opt}: {o:?}");
    }
    for c in COMMANDS {
        assert!(o.stdout.contains(&format!("\n  {c}")), "{c}: {o:?}");
        for args in [&[c, "--help"][..], &[c, "-h"], &["--help", c]] {
            let h = ctl(None, args);
            assert_eq!(h.code, 0, "{args:?}: {h:?}");
            assert!(
                h.stdout
                    .starts_with(&format!("cubenetctl [OPTIONS...] {c}")),
                "{args:?}: {h:?}"
            );
            // Only this command: no global option or exit status table,
            // a pointer to where they are.
            assert!(h.stdout.contains("'cubenetctl --help'"), "{args:?}: {h:?}");
            assert!(!h.stdout.contains("Exit status:"), "{args:?}: {h:?}");
            assert!(!h.stdout.contains("--bus=BUS"), "{args:?}: {h:?}");
            for other in COMMANDS.iter().filter(|o| *o != c) {
                assert!(
                    !h.stdout
                        .contains(&format!("cubenetctl [OPTIONS...] {other}")),
                    "{args:?}: {h:?}"
                );
            }
        }
    }
    let o = ctl(None, &["ensure", "--help"]);
    assert!(o.stdout.contains("--port=PROTO:CONTAINER"), "{o:?}");
    let o = ctl(None, &["list", "--help"]);
    assert!(!o.stdout.contains("--port="), "{o:?}");
    let want = format!("cubenetctl {}\n", env!("CARGO_PKG_VERSION"));
    for v in ["--version", "-V"] {
        let o = ctl(None, &[v]);
        assert_eq!(
            (o.code, o.stdout.as_str()),
            (0, want.as_str()),
            "{v}: {o:?}"
        );
    }
}

/// A tool the test needs: missing is a skip on a developer's machine and a
/// failure under CI (scripts/deps.sh installs it there).
fn tool_or_skip(name: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            !common::in_ci(),
            "{name} is missing (scripts/deps.sh installs it)"
        );
        eprintln!("skipping: {name} is not installed");
    }
    found
}

#[test]
fn man_page_renders_cleanly_and_covers_everything() {
    if !tool_or_skip("man") {
        return;
    }
    let page = Path::new(ROOT).join("man/cubenetctl.1");
    for width in ["60", "80", "120"] {
        let o = Command::new("man")
            .args(["--warnings", "-l"])
            .arg(&page)
            .env("MANWIDTH", width)
            .env("LANG", "C.UTF-8")
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.is_empty(), "MANWIDTH={width}: {err}");
    }
    let o = Command::new("man")
        .args(["-l"])
        .arg(&page)
        .env("MANWIDTH", "200")
        .env("LANG", "C.UTF-8")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).replace('\u{2010}', "-");
    for section in [
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "COMMANDS",
        "OPTIONS",
        "JSON OUTPUT",
        "EXIT STATUS",
        "ENVIRONMENT",
        "EXAMPLES",
        "SEE ALSO",
    ] {
        assert!(text.contains(&format!("\n{section}\n")), "{section}");
    }
    for c in COMMANDS {
        assert!(text.contains(&format!("\n       {c}")), "command {c}");
    }
    // Options are checked in the source (a rendered page may hyphenate).
    let src = std::fs::read_to_string(&page).unwrap();
    let mut opts = long_options(&ctl(None, &["--help"]).stdout);
    opts.extend(long_options(&ctl(None, &["ensure", "--help"]).stdout));
    let flows = long_options(&ctl(None, &["flows", "--help"]).stdout);
    for o in ["--denied", "--follow", "--since"] {
        assert!(flows.contains(o), "{o} not in flows --help: {flows:?}");
    }
    opts.extend(flows);
    assert!(opts.len() >= 15, "{opts:?}");
    for o in &opts {
        let roff = o.replace('-', "\\-");
        assert!(
            src.contains(&roff),
            "option {o} ({roff}) not in the man page"
        );
    }
    for s in [
        "-j",
        "-q, --quiet",
        "-V, --version",
        "CUBENETCTL_BUS",
        "CUBENETCTL_VARLINK",
        "cube-network-agent(8)",
        "cube-cni(8)",
        "busctl(1)",
        "networkctl(1)",
    ] {
        assert!(text.contains(s), "{s} not in the man page");
    }
    for code in ["0", "1", "2", "3", "4"] {
        assert!(
            text.contains(&format!("\n       {code}      ")),
            "exit {code}"
        );
    }
}

/// Runs `script` in `bash --norc -c` after sourcing the completion file.
fn bash(script: &str, envs: &[(&str, &str)]) -> String {
    let file = Path::new(ROOT).join("completions/cubenetctl.bash");
    let mut cmd = Command::new("bash");
    cmd.args(["--norc", "--noprofile", "-c"])
        .arg(format!("source {}\n{script}", file.display()));
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("running bash");
    assert!(o.status.success(), "{script}: {o:?}");
    assert!(o.stderr.is_empty(), "{script}: {o:?}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Completes `line` (cursor at its end) the way bash splits it: words at
/// whitespace, and `=` and `:` (COMP_WORDBREAKS) as words of their own.
fn complete(line: &str, envs: &[(&str, &str)]) -> Vec<String> {
    let mut words: Vec<String> = vec![];
    for w in line.split_whitespace() {
        let mut cur = String::new();
        for c in w.chars() {
            if c == '=' || c == ':' {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
                words.push(c.to_string());
            } else {
                cur.push(c);
            }
        }
        if !cur.is_empty() {
            words.push(cur);
        }
    }
    if line.ends_with(' ') {
        words.push(String::new());
    }
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let script = format!(
        "COMP_WORDS=({})\nCOMP_CWORD={}\nCOMP_LINE='{line}'\nCOMP_POINT=${{#COMP_LINE}}\n\
         _cubenetctl cubenetctl \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        quoted.join(" "),
        words.len() - 1
    );
    let mut out: Vec<String> = bash(&script, envs)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    out.sort();
    out
}

#[test]
fn bash_completion_completes_commands_options_and_values() {
    if !tool_or_skip("bash") {
        return;
    }
    let reg = bash("complete -p cubenetctl", &[]);
    assert_eq!(reg.trim(), "complete -F _cubenetctl cubenetctl");
    // Also when driven through COMP_WORDS/COMP_CWORD alone (no COMP_LINE).
    let out = bash(
        "COMP_WORDS=(cubenetctl sta); COMP_CWORD=1; _cubenetctl cubenetctl sta cubenetctl; \
         printf '%s\\n' \"${COMPREPLY[@]}\"",
        &[],
    );
    assert_eq!(out, "status\n");
    let none = [("CUBENETCTL_BUS", "unix:path=/nonexistent")];
    assert_eq!(complete("cubenetctl sta", &none), ["status"]);
    assert_eq!(complete("cubenetctl re", &none), ["reconcile", "release"]);
    let mut all = COMMANDS.to_vec();
    all.sort();
    assert_eq!(complete("cubenetctl ", &none), all);
    assert_eq!(complete("cubenetctl -q w", &none), ["watch"]);
    assert_eq!(complete("cubenetctl --no-l", &none), ["--no-legend"]);
    assert_eq!(
        complete("cubenetctl --json=", &none),
        ["off", "pretty", "short"]
    );
    assert_eq!(complete("cubenetctl --json=p", &none), ["pretty"]);
    assert_eq!(
        complete("cubenetctl ensure x --p", &none),
        ["--paused", "--port="]
    );
    assert_eq!(complete("cubenetctl ensure x --po", &none), ["--port="]);
    assert_eq!(complete("cubenetctl list --p", &none), Vec::<String>::new());
    assert_eq!(
        complete("cubenetctl ensure x --no-i", &none),
        ["--no-internet"]
    );
    assert_eq!(
        complete("cubenetctl ensure x --port=", &none),
        ["tcp:", "udp:"]
    );
    assert_eq!(complete("cubenetctl --bus s", &none), ["session", "system"]);
    assert_eq!(complete("cubenetctl open-tap x ", &none), ["--"]);
    // flows: its own options, and --since's durations.
    assert_eq!(
        complete("cubenetctl flows --", &none)
            .into_iter()
            .filter(|o| ["--denied", "--follow", "--since="].contains(&o.as_str()))
            .count(),
        3
    );
    assert_eq!(complete("cubenetctl flows -f --si", &none), ["--since="]);
    assert_eq!(
        complete("cubenetctl flows --since=", &none),
        ["10m", "1h", "30s"]
    );
    assert_eq!(
        complete("cubenetctl flows --since ", &none),
        ["10m", "1h", "30s"]
    );
    assert_eq!(
        complete("cubenetctl list --si", &none),
        Vec::<String>::new()
    );
    // Every global option is offered.
    let opts = complete("cubenetctl -", &none);
    for o in [
        "--help",
        "--version",
        "--bus=",
        "--varlink=",
        "--json=",
        "-j",
        "-q",
        "--quiet",
        "--no-legend",
        "--no-pager",
        "-V",
        "-h",
    ] {
        assert!(opts.iter().any(|x| x == o), "{o}: {opts:?}");
    }
    // Ids: the agent cannot be asked, so none, and no error.
    assert_eq!(complete("cubenetctl status ", &none), Vec::<String>::new());
}

/// Sandbox ids come from `cubenetctl list --no-legend -q` on the bus of
/// the command line (or $CUBENETCTL_BUS).
#[test]
fn bash_completion_offers_sandbox_ids() {
    require_root!();
    let env = Env::new(&["--datapath", "none"]);
    let bus = Some(env.address.as_str());
    for id in ["sbx-1", "sbx-2", "web"] {
        assert_eq!(ctl(bus, &["ensure", id]).code, 0);
    }
    let dir = Path::new(CTL)
        .parent()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let path = format!("{dir}:{}", std::env::var("PATH").unwrap_or_default());
    let envs = [
        ("PATH", path.as_str()),
        ("CUBENETCTL_BUS", env.address.as_str()),
    ];
    for verb in [
        "status",
        "release",
        "reconcile",
        "open-tap",
        "ensure",
        "flows",
    ] {
        assert_eq!(
            complete(&format!("cubenetctl {verb} "), &envs),
            ["sbx-1", "sbx-2", "web"],
            "{verb}"
        );
    }
    assert_eq!(complete("cubenetctl status sb", &envs), ["sbx-1", "sbx-2"]);
    assert_eq!(
        complete("cubenetctl status web ", &envs),
        Vec::<String>::new()
    );
    // The --bus of the command line wins over the environment.
    let envs = [
        ("PATH", path.as_str()),
        ("CUBENETCTL_BUS", "unix:path=/nonexistent"),
    ];
    assert_eq!(
        complete(
            &format!("cubenetctl --bus {} release w", env.address),
            &envs
        ),
        ["web"]
    );
}

#[test]
fn zsh_completion_parses() {
    if !tool_or_skip("zsh") {
        return;
    }
    let file = Path::new(ROOT).join("completions/_cubenetctl");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.starts_with("#compdef cubenetctl\n"));
    for c in COMMANDS {
        assert!(text.contains(&format!("'{c}:")), "command {c}");
    }
    let o = Command::new("zsh").arg("-n").arg(&file).output().unwrap();
    assert!(o.status.success() && o.stderr.is_empty(), "{o:?}");
}

/// Capacity on every edge (`cubenetctl capacity`, D-Bus through it, and
/// varlink) follows fills and releases; refusals for want of a node
/// resource are NodeFull naming it, and change nothing; bandwidth limits
/// set with `cubenetctl ensure --egress-rate` are admitted against the
/// node's total.
#[test]
fn capacity_follows_fills_and_node_full_names_the_resource() {
    require_root!();
    let (env, _world) = common::world::node(&[
        "--pool-cidr",
        "10.77.0.0/29",
        "--warm-pool",
        "2",
        "--node-egress-rate",
        "100M",
        "--default-ingress-rate",
        "5M",
        "--labels",
        "zone=z1,rack=r7",
    ]);
    let bus = Some(env.address.as_str());
    let cap = |env: &Env| {
        let o = ctl(Some(env.address.as_str()), &["capacity", "--json"]);
        assert_eq!(o.code, 0, "{o:?}");
        let j = json(&o);
        // The same numbers over varlink (taken right after: nothing
        // changes in between).
        let v = varlink(env, "Capacity", json!({})).unwrap()["capacity"].clone();
        for k in [
            "networks",
            "addresses_free",
            "egress_bps_committed",
            "host_ports_free_tcp",
        ] {
            assert_eq!(j[k], v[k], "{k}: cubenetctl {j}, varlink {v}");
        }
        j
    };
    let c0 = cap(&env);
    assert_eq!(c0["networks"], 0);
    assert_eq!(c0["addresses_free"], 5, "{c0}");
    assert_eq!(c0["addresses_total"], 5);
    assert_eq!(c0["egress_bps_total"], 100_000_000u64);
    assert_eq!(c0["egress_bps_committed"], 0);
    assert_eq!(c0["labels"], json!({"zone": "z1", "rack": "r7"}));
    assert!(c0["taps_creatable"].as_u64().unwrap() >= 5, "{c0}");
    assert_eq!(c0["host_ports_total"], 10_000);

    let ok = |args: &[&str]| {
        let o = ctl(bus, args);
        assert_eq!(o.code, 0, "{args:?}: {o:?}");
    };
    ok(&["ensure", "s0", "--egress-rate", "30M", "--port", "tcp:80"]);
    let c1 = cap(&env);
    assert_eq!(c1["networks"], 1);
    assert_eq!(c1["addresses_free"], 4);
    assert_eq!(c1["egress_bps_committed"], 30_000_000u64);
    // The node's default ingress limit applies to a network without one.
    assert_eq!(c1["ingress_bps_committed"], 5_000_000u64);
    assert_eq!(
        c1["host_ports_free_tcp"].as_u64().unwrap() + 1,
        c0["host_ports_free_tcp"].as_u64().unwrap()
    );
    let status = json(&ctl(bus, &["status", "s0", "--json"]));
    assert_eq!(status["egress_bps"], 30_000_000u64);
    assert_eq!(status["ingress_bps"], 5_000_000u64);
    assert!(
        ctl(bus, &["status", "s0"])
            .stdout
            .contains("Egress limit: 30Mbit"),
        "{:?}",
        ctl(bus, &["status", "s0"])
    );

    // Beyond the node's total: NodeFull, nothing changed.
    let o = ctl(bus, &["ensure", "s1", "--egress-rate", "80M"]);
    assert_ne!(o.code, 0);
    assert!(
        o.stderr.contains("node full (egress_bandwidth)") && o.stderr.contains("--egress-rate 80M"),
        "{o:?}"
    );
    assert_eq!(cap(&env), c1);
    assert_eq!(ctl(bus, &["status", "s1"]).code, 3);
    let e = varlink(
        &env,
        "EnsureNetwork",
        json!({"sandbox_id": "s1", "options": {"egress_bps": 80_000_000u64}}),
    )
    .unwrap_err();
    assert_eq!(e.0, "org.cube.NetworkAgent.NodeFull", "{e:?}");
    assert_eq!(e.1["resource"], "egress_bandwidth", "{e:?}");
    ok(&["ensure", "s1", "--egress-rate", "70M"]);
    assert_eq!(cap(&env)["egress_bps_committed"], 100_000_000u64);
    // A converge that grows past the total is refused and keeps the old
    // limit; one that shrinks always passes.
    let o = ctl(
        bus,
        &["ensure", "s0", "--egress-rate", "40M", "--port", "tcp:80"],
    );
    assert!(o.stderr.contains("node full (egress_bandwidth)"), "{o:?}");
    assert_eq!(
        json(&ctl(bus, &["status", "s0", "--json"]))["egress_bps"],
        30_000_000u64
    );
    ok(&["ensure", "s0", "--egress-rate", "10M", "--port", "tcp:80"]);
    assert_eq!(cap(&env)["egress_bps_committed"], 80_000_000u64);

    // Fill the pool: the next one is NodeFull (addresses).
    for id in ["s2", "s3", "s4"] {
        ok(&["ensure", id]);
    }
    let full = cap(&env);
    assert_eq!(full["addresses_free"], 0);
    assert_eq!(full["networks"], 5);
    let o = ctl(bus, &["ensure", "s5"]);
    assert!(o.stderr.contains("node full (addresses)"), "{o:?}");
    let e = varlink(&env, "EnsureNetwork", json!({"sandbox_id": "s5"})).unwrap_err();
    assert_eq!(e.1["resource"], "addresses", "{e:?}");
    assert_eq!(cap(&env), full);

    // Releases give everything back.
    ok(&["release", "s1"]);
    ok(&["release", "s0"]);
    let after = cap(&env);
    assert_eq!(after["addresses_free"], 2);
    assert_eq!(after["egress_bps_committed"], 0);
    assert_eq!(after["ingress_bps_committed"], 15_000_000u64);
    assert_eq!(after["host_ports_free_tcp"], c0["host_ports_free_tcp"]);
    // And the same numbers as metrics.
    let m = ctl_env(
        None,
        &[(
            "CUBENETCTL_REPORT",
            env.dir
                .join("report/org.cube.NetworkAgent")
                .to_str()
                .unwrap(),
        )],
        &["metrics"],
    );
    assert!(
        m.stdout
            .contains("cube_network_agent_capacity{resource=\"addresses_free\"} 2"),
        "{m:?}"
    );
}

/// The TAP of `id`, through OpenTap on D-Bus.
fn open_tap(env: &Env, id: &str) -> std::os::fd::OwnedFd {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async { env.client().await.open_tap(id).await.unwrap() })
}

/// `cubenetctl status` shows what a sandbox's bandwidth shapers did, in
/// their own unit (segments on the wire, as HTB and the metrics count
/// them; the device's packet counts take a GSO packet once), and the
/// numbers are GetNetwork's and the metrics'.
#[test]
fn status_shows_the_shapers_in_their_unit() {
    use common::guest::{GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, udp_frame};
    require_root!();
    let (env, world) = common::world::node(&[]);
    let bus = Some(env.address.as_str());
    let o = ctl(
        bus,
        &["ensure", "shp", "--egress-rate=10M", "--ingress-rate=20M"],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let echo = world.udp_echo(0);
    let guest = RawGuest::new(open_tap(&env, "shp"));
    for i in 0..5u8 {
        let f = udp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            std::net::SocketAddrV4::new(GUEST_IP, 41000),
            echo,
            &[i; 200],
        );
        guest.send(&f).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = 0;
    while got < 5 && Instant::now() < deadline {
        got += guest.recv(Duration::from_millis(200)).len();
    }
    assert!(got >= 5, "echoes: {got}");

    let o = ctl(bus, &["status", "shp"]);
    assert_eq!(o.code, 0, "{o:?}");
    let line = |dir: &str| -> String {
        o.stdout
            .lines()
            .find(|l| l.contains(&format!("{dir} shaper (")))
            .unwrap_or_else(|| panic!("no {dir} shaper line: {o:?}"))
            .to_owned()
    };
    // "egress shaper (10Mbit): sent B bytes in N segments (wire packets:
    // ...), held back D times, X packets dropped with its queue full"
    let segments = |l: &str| -> u64 {
        let after = l
            .split(" bytes in ")
            .nth(1)
            .unwrap_or_else(|| panic!("{l}"));
        after.split(' ').next().unwrap().parse().unwrap()
    };
    let (eg, ing) = (line("egress"), line("ingress"));
    assert!(eg.contains("egress shaper (10Mbit): sent "), "{eg}");
    assert!(ing.contains("ingress shaper (20Mbit): received "), "{ing}");
    assert!(eg.contains("a GSO packet counts per segment"), "{eg}");
    assert!(
        o.stdout.contains("packets (a GSO packet counts once;"),
        "the device's unit: {o:?}"
    );
    let t =
        varlink(&env, "GetNetwork", json!({"sandbox_id": "shp"})).unwrap()["network"]["traffic"]
            .clone();
    assert_eq!(
        segments(&eg),
        t["egress_shaped_packets"].as_u64().unwrap(),
        "{t}"
    );
    assert_eq!(
        segments(&ing),
        t["ingress_shaped_packets"].as_u64().unwrap(),
        "{t}"
    );
    assert!(segments(&eg) >= 5 && segments(&ing) >= 5, "{eg}\n{ing}");
    let m = ctl_env(
        None,
        &[(
            "CUBENETCTL_REPORT",
            env.dir
                .join("report/org.cube.NetworkAgent")
                .to_str()
                .unwrap(),
        )],
        &["metrics"],
    );
    for (dir, l) in [("egress", &eg), ("ingress", &ing)] {
        let sample = m
            .stdout
            .lines()
            .find(|s| {
                s.starts_with("cube_network_agent_sandbox_shaped_packets_total{")
                    && s.contains("sandbox_id=\"shp\"")
                    && s.contains(&format!("direction=\"{dir}\""))
            })
            .unwrap_or_else(|| panic!("no {dir} sample: {m:?}"));
        assert!(
            sample.ends_with(&format!(" {}", segments(l))),
            "{sample} vs {l}"
        );
    }
    // Without a limit: no shaper lines.
    assert_eq!(ctl(bus, &["ensure", "free"]).code, 0);
    let o = ctl(bus, &["status", "free"]);
    assert!(!o.stdout.contains("shaper"), "{o:?}");
}

/// On a node with IPv6 egress, README's `cubenetctl ensure sbx-1 --port
/// tcp:80 --deny-out 10.0.0.0/8` has no IPv6 egress: GetNetwork (D-Bus and
/// varlink) and `status` say why and what opens it; doing what it says
/// opens it; a node that loses its IPv6 egress says so instead.
#[test]
fn no_ipv6_egress_says_why_and_how_to_open_it() {
    require_root!();
    let mut env = Env::new(&[]);
    let world = common::world::World::attach(&env);
    world.add_ipv6(&[]);
    env.kill_agent();
    env.start_agent();
    let bus = Some(env.address.as_str());
    // Health's uplink row names the address NAT66 uses, or says there is
    // none (docs/dual-stack.md "How to").
    let uplink_row = || -> String {
        let h = json(&ctl(bus, &["health", "--json"]));
        h["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "uplink")
            .map(|c| c["detail"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let row = uplink_row();
    assert!(
        row.contains(&common::world::NODE_IP6.to_string()) && !row.contains("no IPv6"),
        "{row}"
    );
    let readme = [
        "ensure",
        "sbx-1",
        "--port",
        "tcp:80",
        "--deny-out",
        "10.0.0.0/8",
    ];
    let o = ctl(bus, &readme);
    assert_eq!(o.code, 0, "{o:?}");
    let egress_line = |o: &Out| -> String {
        o.stdout
            .lines()
            .find(|l| l.trim_start().starts_with("IPv6 egress:"))
            .unwrap_or_else(|| panic!("no IPv6 egress line: {o:?}"))
            .trim()
            .to_owned()
    };
    let l = egress_line(&o);
    assert!(
        l.starts_with("IPv6 egress: no (its rules are IPv4 CIDRs only") && l.contains("fc00::/7"),
        "{l}"
    );
    assert_eq!(egress_line(&ctl(bus, &["status", "sbx-1"])), l);
    // The same reason on both wires.
    let dbus = json(&ctl(bus, &["status", "sbx-1", "--json"]));
    let vl =
        varlink(&env, "GetNetwork", json!({"sandbox_id": "sbx-1"})).unwrap()["network"].clone();
    assert_eq!(dbus["ipv6_egress"], false, "{dbus}");
    let why = dbus["ipv6_egress_reason"].as_str().unwrap_or_default();
    assert!(why.starts_with("its rules are IPv4 CIDRs only"), "{dbus}");
    assert_eq!(vl["ipv6_egress_reason"], dbus["ipv6_egress_reason"]);

    // What it says: the rules' IPv6 side opens IPv6.
    let o = ctl(bus, &[&readme[..], &["--deny-out", "fc00::/7"]].concat());
    assert_eq!(egress_line(&o), "IPv6 egress: yes", "{o:?}");
    let j = json(&ctl(bus, &["status", "sbx-1", "--json"]));
    assert_eq!(j["ipv6_egress"], true, "{j}");
    assert!(j.get("ipv6_egress_reason").is_none(), "{j}");

    // No internet access, and the catch-all deny: each says its own.
    let o = ctl(bus, &["ensure", "sbx-2", "--no-internet"]);
    assert!(egress_line(&o).contains("allow_internet_access"), "{o:?}");
    let o = ctl(bus, &["ensure", "sbx-3", "--deny-out", "::/0"]);
    assert!(egress_line(&o).contains("catch-all"), "{o:?}");

    // The node loses its IPv6 default route: every sandbox says that.
    env.ns_cmd(&["ip", "-6", "route", "del", "default"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let l = egress_line(&ctl(bus, &["status", "sbx-1"]));
        if l.starts_with("IPv6 egress: no (the node has no IPv6 egress: its uplink up0") {
            break;
        }
        assert!(Instant::now() < deadline, "{l}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let row = uplink_row();
    assert!(
        row.contains("; no IPv6 egress: up0 has no usable global"),
        "{row}"
    );
}

/// `cubenetctl` with `input` on its stdin.
fn ctl_stdin(address: Option<&str>, args: &[&str], input: &str) -> Out {
    let mut cmd = command(&[]);
    if let Some(a) = address {
        cmd.args(["--bus", a]);
    }
    let mut child = cmd
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running cubenetctl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Egress rules from a file (`ensure --egress-rules`, `egress-rules ID
/// FILE`): the header names and the agent's digests show in `status`,
/// `list` and `--json` (equal to varlink's), the secrets nowhere, in no
/// command's output or error; a malformed file names the field and
/// changes nothing; `egress-ca` prints the node CA's certificate.
#[test]
fn egress_rules_from_a_file_never_show_the_secret() {
    use cube_network_agent::rules::Secret;
    use std::os::unix::fs::PermissionsExt;
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());
    const SECRET: &str = "Bearer sk-s3cr3t-0123456789";
    const SECRET2: &str = "Bearer sk-r0tated-9876543210";
    let digest = |v: &str| Secret::new(v.into()).digest();
    let mut seen: Vec<Out> = vec![];
    let file = |name: &str, text: &str| -> String {
        let p = env.dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let rules = file(
        "rules.json",
        &format!(
            r#"[{{"host": "api.test", "set_headers": {{"Authorization": "{SECRET}", "X-Team": "{SECRET2}"}},
                 "methods": ["get"], "paths": ["/v1"]}},
               {{"host": "*.mirror.test", "plain_http": true}}]"#
        ),
    );
    let rules_of = |net: &Value| net["egress_rules"].clone();
    let want = json!([
        {"host": "api.test",
         "set_headers": {"authorization": digest(SECRET), "x-team": digest(SECRET2)},
         "methods": ["GET"], "paths": ["/v1"], "plain_http": false},
        {"host": "*.mirror.test", "set_headers": {}, "methods": [], "paths": [],
         "plain_http": true},
    ]);

    let o = ctl(bus, &["ensure", "sbx-r", "--egress-rules", &rules]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(
        o.stdout.contains("Egress rules: api.test: headers "),
        "{o:?}"
    );
    seen.push(o);
    let o = ctl(
        bus,
        &[
            "ensure",
            "sbx-r",
            &format!("--egress-rules={rules}"),
            "--json",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(rules_of(&json(&o)), want, "{o:?}");
    seen.push(o);
    let o = ctl(bus, &["status", "sbx-r"]);
    assert_eq!(o.code, 0, "{o:?}");
    for line in [
        format!(
            "Egress rules: api.test: headers authorization={}, x-team={}; methods GET; paths /v1; \
             plain HTTP no",
            digest(SECRET),
            digest(SECRET2)
        ),
        "*.mirror.test: headers none; methods any; paths any; plain HTTP yes".to_owned(),
    ] {
        assert!(o.stdout.contains(&line), "{line}: {o:?}");
    }
    seen.push(o);
    // --json: the digests, as varlink's GetNetwork and ListNetworks say.
    let o = ctl(bus, &["status", "sbx-r", "--json"]);
    let vl =
        varlink(&env, "GetNetwork", json!({"sandbox_id": "sbx-r"})).unwrap()["network"].clone();
    assert_eq!(rules_of(&json(&o)), want, "{o:?}");
    assert_eq!(rules_of(&json(&o)), rules_of(&vl));
    seen.push(o);
    let o = ctl(bus, &["list", "--json"]);
    assert_eq!(rules_of(&json(&o)[0]), want, "{o:?}");
    seen.push(o);
    let o = ctl(bus, &["list"]);
    assert_eq!(o.code, 0, "{o:?}");
    seen.push(o);
    // A network without rules says [] on both edges.
    let o = ctl(bus, &["ensure", "sbx-plain", "--json"]);
    assert_eq!(json(&o)["egress_rules"], json!([]), "{o:?}");
    seen.push(o);

    // Malformed files: the field is named, nothing is sent, nothing changes.
    let bad = [
        (
            "newline.json",
            format!(r#"[{{"host": "api.test", "set_headers": {{"X-A\nB": "{SECRET}"}}}}]"#),
            "[0].set_headers: header name",
        ),
        (
            "unknown.json",
            format!(r#"[{{"host": "api.test", "set_header": {{"Authorization": "{SECRET}"}}}}]"#),
            "[0].\"set_header\": unknown key",
        ),
        (
            "type.json",
            format!(
                r#"[{{"host": "api.test", "set_headers": {{"Authorization": "{SECRET}"}}}},
                    {{"host": "b.test", "methods": "GET"}}]"#
            ),
            "[1].methods: expected an array of strings, got a string",
        ),
        (
            "value.json",
            r#"[{"host": "api.test", "set_headers": {"Authorization": 7}}]"#.to_owned(),
            "[0].set_headers[\"Authorization\"]: expected a string, got a number",
        ),
    ];
    for (name, text, what) in &bad {
        let path = file(name, text);
        for args in [
            vec!["ensure", "sbx-r", "--egress-rules", path.as_str()],
            vec!["egress-rules", "sbx-r", path.as_str()],
        ] {
            let o = ctl(bus, &args);
            assert_eq!(o.code, 2, "{args:?}: {o:?}");
            assert!(
                o.stderr.starts_with(&format!("cubenetctl: {path}: {what}")),
                "{args:?}: {o:?}"
            );
            assert_prefixed(&o);
            seen.push(o);
        }
        let o = ctl(bus, &["status", "sbx-r", "--json"]);
        assert_eq!(rules_of(&json(&o)), want, "{name} changed the rules: {o:?}");
        seen.push(o);
    }
    // The agent's own refusal (one rule per host) names the file too.
    let dup = file(
        "dup.json",
        &format!(
            r#"[{{"host": "api.test", "set_headers": {{"Authorization": "{SECRET}"}}}},
                {{"host": "API.test"}}]"#
        ),
    );
    let o = ctl(bus, &["ensure", "sbx-r", "--egress-rules", &dup]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr
            .contains(&format!("--egress-rules {dup} (egress_rules[1].host)")),
        "{o:?}"
    );
    seen.push(o);
    let o = ctl(bus, &["egress-rules", "sbx-r", &dup]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr.contains(&format!("{dup} (egress_rules[1].host)")),
        "{o:?}"
    );
    seen.push(o);
    let o = ctl(bus, &["status", "sbx-r", "--json"]);
    assert_eq!(rules_of(&json(&o)), want, "{o:?}");
    seen.push(o);

    // egress-rules ID FILE replaces them (here from stdin), nothing else.
    let before = without_traffic(json(&ctl(bus, &["status", "sbx-r", "--json"])));
    let o = ctl_stdin(
        bus,
        &["egress-rules", "sbx-r", "-", "--json"],
        &format!(r#"[{{"host": "api.test", "set_headers": {{"Authorization": "{SECRET2}"}}}}]"#),
    );
    assert_eq!(o.code, 0, "{o:?}");
    let replaced = json!([{"host": "api.test", "set_headers": {"authorization": digest(SECRET2)},
        "methods": [], "paths": [], "plain_http": false}]);
    assert_eq!(rules_of(&json(&o)), replaced, "{o:?}");
    seen.push(o);
    let mut after = without_traffic(json(&ctl(bus, &["status", "sbx-r", "--json"])));
    assert_eq!(rules_of(&after), replaced);
    after["egress_rules"] = before["egress_rules"].clone();
    assert_eq!(after, before, "only the rules changed");
    let o = ctl(bus, &["egress-rules", "sbx-r", &file("two.json", "[]")]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("Egress rules: -\n"), "{o:?}");
    seen.push(o);
    let o = ctl(bus, &["egress-rules", "sbx-none", &rules]);
    assert_eq!(o.code, 3, "{o:?}");
    seen.push(o);

    // The node CA: the property, as the state directory has it.
    let o = ctl(bus, &["egress-ca"]);
    assert_eq!(o.code, 0, "{o:?}");
    let pem = std::fs::read_to_string(env.dir.join("state/egress-ca.crt")).unwrap();
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
    assert_eq!(o.stdout.trim_end(), pem.trim_end(), "{o:?}");
    seen.push(o);
    let o = ctl(bus, &["egress-ca", "--json"]);
    assert_eq!(
        json(&o)["certificate"].as_str(),
        Some(pem.as_str()),
        "{o:?}"
    );
    seen.push(o);

    for o in &seen {
        for s in [SECRET, SECRET2, "s3cr3t", "r0tated"] {
            assert!(
                !o.stdout.contains(s) && !o.stderr.contains(s),
                "a secret in the output: {o:?}"
            );
        }
    }
}
