//! The egress gateway's tests (tests/gateway.rs, its benchmark): a test
//! CA and leaves made with openssl, the upstream in the world
//! (tests/gateway/upstream.py), what it logged, one varlink call.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::world::World;

/// A process killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (Debian package openssl; .ci/run installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A test CA (`ca.pem`) and leaves it signed: `NAME.pem`/`NAME.key` for
/// each (file name, DNS name in the certificate).
pub fn certificates(dir: &Path, leaves: &[(&str, &str)]) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut a = vec!["req", "-x509"];
    a.extend(ec);
    a.extend([
        "-days",
        "2",
        "-subj",
        "/CN=gateway test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&a, dir);
    for (file, name) in leaves {
        let (key, csr, pem, ext) = (
            format!("{file}.key"),
            format!("{file}.csr"),
            format!("{file}.pem"),
            format!("{file}.ext"),
        );
        std::fs::write(
            dir.join(&ext),
            format!(
                "subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
            ),
        )
        .unwrap();
        let mut a = vec!["req"];
        a.extend(ec);
        let subj = format!("/CN={name}");
        a.extend(["-subj", &subj, "-keyout", &key, "-out", &csr]);
        openssl(&a, dir);
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
            dir,
        );
    }
}

/// tests/gateway/upstream.py in the world on `addr:port` (TLS with
/// `leaf`'s certificate when given), logging to `log`.
pub fn upstream(
    world: &World,
    dir: &Path,
    addr: &str,
    port: u16,
    leaf: Option<&str>,
) -> (Proc, PathBuf) {
    upstream_in(&world.ns, dir, addr, port, leaf)
}

/// [`upstream`] in the network namespace `ns` (the node's, say).
pub fn upstream_in(
    ns: &str,
    dir: &Path,
    addr: &str,
    port: u16,
    leaf: Option<&str>,
) -> (Proc, PathBuf) {
    let log = dir.join(format!("upstream-{ns}-{addr}-{port}.log"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gateway/upstream.py");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, "python3"])
        .arg(&script)
        .args([addr, &port.to_string()])
        .arg(&log);
    if let Some(leaf) = leaf {
        cmd.arg(dir.join(format!("{leaf}.pem")))
            .arg(dir.join(format!("{leaf}.key")));
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "upstream on {addr}:{port}");
    (Proc(child), log)
}

/// The requests an upstream logged: (method, path, headers, and the
/// pseudo-header `:peer`: the client's address and port).
pub fn logged(log: &Path) -> Vec<(String, String, HashMap<String, String>)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut headers: HashMap<String, String> = v["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            // The connection it came on (the proxy's side of it).
            headers.insert(
                ":peer".into(),
                v["peer"].as_str().unwrap_or_default().into(),
            );
            (
                v["method"].as_str().unwrap().to_owned(),
                v["path"].as_str().unwrap().to_owned(),
                headers,
            )
        })
        .collect()
}

/// One varlink call on the agent's socket: the reply's text.
pub fn varlink(env: &super::Env, call: serde_json::Value) -> String {
    use std::io::{Read, Write};
    let mut sock =
        std::os::unix::net::UnixStream::connect(env.dir.join("run/org.cube.NetworkAgent")).unwrap();
    let mut msg = call.to_string().into_bytes();
    msg.push(0);
    sock.write_all(&msg).unwrap();
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while sock.read(&mut byte).unwrap() == 1 && byte[0] != 0 {
        reply.push(byte[0]);
    }
    String::from_utf8(reply).unwrap()
}

pub fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}
