//! End-to-end tests of `cubenetctl`: the real binary against the real agent
//! (in its own network namespace, on a private bus). Root only.

mod common;

use std::process::Command;

use common::Env;

const CTL: &str = env!("CARGO_BIN_EXE_cubenetctl");

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

/// Runs `cubenetctl --bus ADDRESS ARGS...` (no `--bus` if `address` is None).
fn ctl(address: Option<&str>, args: &[&str]) -> Out {
    let mut cmd = Command::new(CTL);
    cmd.env_remove("CUBENETCTL_BUS");
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

fn json(o: &Out) -> serde_json::Value {
    serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {o:?}"))
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
    assert!(o.stdout.contains("udp 53→25053"), "{o:?}");
    assert!(o.stdout.contains("10.0.0.0/8"), "{o:?}");
    assert!(o.stdout.contains("owner=team-a"), "{o:?}");

    // list --json: one entry with the agent's fields.
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
    assert_eq!(n["deny_out"], serde_json::json!(["10.0.0.0/8"]));
    assert_eq!(n["metadata"], serde_json::json!({"owner": "team-a"}));
    let pm = n["port_mappings"].as_array().unwrap();
    assert_eq!(pm.len(), 2, "{pm:?}");
    assert_eq!(pm[0][0], "tcp");
    assert_eq!(pm[0][1], 80);
    let tcp_host = pm[0][2].as_u64().unwrap();
    assert!((20000..=29999).contains(&tcp_host), "{pm:?}");
    assert_eq!(pm[1], serde_json::json!(["udp", 53, 25053, "0.0.0.0"]));

    // list: the table.
    let o = ctl(bus, &["list"]);
    assert_eq!(o.code, 0, "{o:?}");
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert!(lines[0].starts_with("SANDBOX"), "{o:?}");
    for col in ["SANDBOX-IP", "TAP", "MTU", "PORTS"] {
        assert!(lines[0].contains(col), "{o:?}");
    }
    let row = lines[1];
    assert!(row.starts_with("sbx-1 "), "{o:?}");
    assert!(row.contains(&ip) && row.contains(&tap), "{o:?}");
    assert!(row.contains(&format!("tcp 80→{tcp_host}")), "{o:?}");
    assert_eq!(lines.last(), Some(&"1 networks."), "{o:?}");
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
        "Internet: yes",
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
    let s = json(&o);
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
        serde_json::json!([["tcp", 443, 24443, "0.0.0.0"]])
    );
    assert_eq!(
        c["deny_out"],
        serde_json::json!([]),
        "declarative: omitted = default"
    );

    // Reconcile: nothing to repair.
    let o = ctl(bus, &["reconcile"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("Checked: 1"), "{o:?}");
    let o = ctl(bus, &["reconcile", "sbx-1", "--json"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(json(&o)["checked"], 1);

    // Release, then again: exit 3.
    let o = ctl(bus, &["release", "sbx-1"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout.trim(), "released sbx-1");
    let o = ctl(bus, &["release", "sbx-1"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert!(o.stderr.contains("sbx-1: no such network"), "{o:?}");

    // Missing networks: exit 3 with the agent's NotFound.
    let o = ctl(bus, &["status", "sbx-1"]);
    assert_eq!(o.code, 3, "{o:?}");
    assert!(o.stderr.starts_with("cubenetctl: NotFound: "), "{o:?}");
    assert!(o.stderr.contains("sbx-1"), "{o:?}");
    let o = ctl(bus, &["list"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.contains("0 networks."), "{o:?}");
    let o = ctl(bus, &["list", "--json"]);
    assert_eq!(json(&o), serde_json::json!([]));
}

#[test]
fn errors_have_distinct_exit_codes() {
    require_root!();
    let env = Env::new(&[]);
    let bus = Some(env.address.as_str());

    // Usage errors: exit 2, the message names the flag; nothing is called.
    let o = ctl(bus, &["ensure", "sbx-e", "--port", "tcp:80:x"]);
    assert_eq!(o.code, 2, "{o:?}");
    assert!(
        o.stderr
            .contains("--port tcp:80:x: host port 'x' is not a number"),
        "{o:?}"
    );
    assert!(o.stderr.contains("--help"), "{o:?}");
    for bad in [
        &["ensure", "sbx-e", "--port", "sctp:80"][..],
        &["ensure", "sbx-e", "--mtu", "big"],
        &["ensure", "sbx-e", "--metadata", "novalue"],
        &["ensure", "sbx-e", "--port"],
        &["status"],
        &["status", "a", "b"],
        &["frobnicate"],
        &["list", "--bogus"],
        &["open-tap", "sbx-e"],
    ] {
        let o = ctl(bus, bad);
        assert_eq!(o.code, 2, "{bad:?}: {o:?}");
        assert!(o.stderr.starts_with("cubenetctl: "), "{bad:?}: {o:?}");
    }
    assert_eq!(ctl(bus, &["list", "--json"]).stdout.trim(), "[]");

    // Agent-side validation: exit 1 with the D-Bus error's short name.
    let o = ctl(bus, &["ensure", "sbx-e", "--mtu", "50"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr.starts_with("cubenetctl: InvalidArgument: "),
        "{o:?}"
    );
    assert!(o.stderr.contains("mtu"), "{o:?}");
    let o = ctl(bus, &["ensure", "sbx-e", "--port", "tcp:0"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(
        o.stderr.contains("InvalidArgument: port_mappings[0]"),
        "{o:?}"
    );
    let o = ctl(bus, &["ensure", "-bad-id"]);
    assert_eq!(o.code, 2, "a leading '-' is an unknown option: {o:?}");
    let o = ctl(bus, &["ensure", "bad/id"]);
    assert_eq!(o.code, 1, "{o:?}");
    assert!(o.stderr.contains("InvalidArgument"), "{o:?}");

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
    let o = Command::new(CTL)
        .env("CUBENETCTL_BUS", &env.address)
        .args(["list", "--no-legend"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
}

#[test]
fn unreachable_agent_is_exit_4() {
    require_root!();
    let o = ctl(Some("unix:path=/nonexistent"), &["list"]);
    assert_eq!(o.code, 4, "{o:?}");
    assert!(o.stderr.starts_with("cubenetctl: "), "{o:?}");

    // A bus where nobody owns the name.
    let mut env = Env::new(&[]);
    env.stop_agent();
    let o = ctl(Some(&env.address), &["status", "x"]);
    assert_eq!(o.code, 4, "{o:?}");
    assert!(o.stderr.contains("ServiceUnknown"), "{o:?}");
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
    let o = ctl(bus, &["open-tap", "nope", "--", "true"]);
    assert_eq!(o.code, 3, "{o:?}");
}

#[test]
fn help_and_version() {
    require_root!();
    let o = ctl(None, &["--help"]);
    assert_eq!(o.code, 0, "{o:?}");
    for c in [
        "list",
        "status",
        "ensure",
        "release",
        "reconcile",
        "health",
        "open-tap",
    ] {
        assert!(o.stdout.contains(c), "{c}: {o:?}");
        for args in [&[c, "--help"][..], &[c, "-h"], &["--help", c]] {
            let o = ctl(None, args);
            assert_eq!(o.code, 0, "{args:?}: {o:?}");
            assert!(
                o.stdout.contains(&format!("cubenetctl [OPTIONS...] {c}")),
                "{args:?}: {o:?}"
            );
            assert!(o.stdout.contains("Exit status"), "{args:?}: {o:?}");
        }
    }
    assert!(o.stdout.contains("Exit status"), "{o:?}");
    let o = ctl(None, &["ensure", "--help"]);
    assert!(o.stdout.contains("--port=PROTO:CONTAINER"), "{o:?}");
    let o = ctl(None, &["--version"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout.starts_with("cubenetctl "), "{o:?}");
}
