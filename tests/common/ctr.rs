//! Containers for tests: a network namespace per container, and cube-cni
//! run the way a runtime runs it (env + stdin, inside the agent's
//! namespace).

use std::process::{Command, Stdio};

use serde_json::{Value, json};

use super::Env;

/// A container network namespace, deleted on drop.
pub struct Ctr {
    pub name: String,
}

impl Ctr {
    pub fn new(tag: &str) -> Ctr {
        let name = format!("cnic-{}-{tag}", std::process::id());
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(Stdio::null())
            .status();
        assert!(
            Command::new("ip")
                .args(["netns", "add", &name])
                .status()
                .unwrap()
                .success()
        );
        Ctr { name }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    pub fn ip_json(&self, args: &[&str]) -> Value {
        let out = Command::new("ip")
            .args(["-n", &self.name, "-j"])
            .args(args)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// `/etc/netns/<name>/resolv.conf` naming `nameserver`: what a runtime
    /// writes from the CNI result's `dns` (`ip netns exec` mounts it over
    /// the container's /etc/resolv.conf). Removed on drop.
    pub fn resolv_conf(&self, nameserver: &str) -> ResolvConf {
        let dir = std::path::Path::new("/etc/netns").join(&self.name);
        std::fs::create_dir_all(&dir).unwrap();
        let conf = ResolvConf(dir.clone());
        std::fs::write(
            dir.join("resolv.conf"),
            format!("nameserver {nameserver}\n"),
        )
        .unwrap();
        conf
    }

    pub fn sh(&self, cmd: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "sh", "-c", cmd])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Ctr {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// One run of the plugin: exit status, stdout as JSON (Null if empty),
/// stderr.
#[derive(Debug)]
pub struct Out {
    pub ok: bool,
    pub json: Value,
    /// Shown by `{:?}` in assertion messages.
    #[allow(dead_code)]
    pub stderr: String,
}

impl Out {
    pub fn code(&self) -> u64 {
        self.json["code"].as_u64().unwrap_or(0)
    }
}

/// Runs cube-cni inside the node namespace (where runtimes run plugins).
pub fn cni(env: &Env, vars: &[(&str, &str)], stdin: &[u8]) -> Out {
    cni_in(env, vars, stdin, false)
}

/// [`cni`] with /proc/sys read-only, as a runtime in a systemd container
/// (nspawn) runs its plugins.
pub fn cni_ro_sys(env: &Env, vars: &[(&str, &str)], stdin: &[u8]) -> Out {
    cni_in(env, vars, stdin, true)
}

fn cni_in(env: &Env, vars: &[(&str, &str)], stdin: &[u8], ro_sys: bool) -> Out {
    use std::io::Write;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &env.ns]);
    if ro_sys {
        cmd.args([
            "unshare",
            "-m",
            "sh",
            "-c",
            "mount --bind -o ro /proc/sys /proc/sys && exec \"$0\"",
        ]);
    }
    cmd.arg(
        std::env::var_os("CNA_TEST_CNI").unwrap_or_else(|| env!("CARGO_BIN_EXE_cube-cni").into()),
    )
    .env_clear()
    .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    Out {
        ok: out.status.success(),
        json: if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("stdout not JSON ({e}): {text}"))
        },
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// ADD of container `cid` (interface eth0) in `ctr` with a minimal
/// configuration plus `extra` keys; panics unless it succeeds. Returns the
/// CNI result.
pub fn add(env: &Env, cid: &str, ctr: &Ctr, extra: Value) -> Value {
    let mut conf = json!({
        "cniVersion": "1.0.0",
        "name": "cube",
        "type": "cube-cni",
        "dbusAddress": env.address,
        "timeoutMs": 5000,
    });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        conf[k] = v;
    }
    let out = cni(
        env,
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", cid),
            ("CNI_NETNS", &ctr.path()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ],
        conf.to_string().as_bytes(),
    );
    assert!(out.ok, "ADD {cid}: {out:?}");
    out.json
}

/// See [`Ctr::resolv_conf`].
pub struct ResolvConf(std::path::PathBuf);

impl Drop for ResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
