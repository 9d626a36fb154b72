//! The egress gateway (issue 46, docs/egress.md "Egress rules"), end to
//! end: a CNI container with curl, egress rules set over D-Bus after ADD,
//! HTTPS upstreams in the world namespace with a test CA of their own
//! (given to the agent as `egress_trust_bundle`), the real eBPF datapath
//! steering the container's TCP to 80/443 to the agent's proxy. Every
//! "never" of the issue is asserted against what the upstream logged,
//! what crossed the container's link, and every output. Root only.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::ctr::{self, Ctr};
use common::gateway::{Proc, certificates, contains, logged, upstream, upstream_in, varlink};
use common::world::node;
use zbus::zvariant::{OwnedValue, Value};

const SECRET: &str = "Bearer sk-live-7f3a9c-never-in-the-sandbox";
const PLAIN_SECRET: &str = "plain-key-51c0de";

type Rule = HashMap<&'static str, Value<'static>>;

fn rule(host: &'static str, headers: &[(&str, &str)], methods: &[&str], paths: &[&str]) -> Rule {
    let mut r = Rule::new();
    r.insert("host", Value::from(host));
    let h: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    r.insert("set_headers", Value::from(h));
    let l = |v: &[&str]| Value::from(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    r.insert("methods", l(methods));
    r.insert("paths", l(paths));
    r
}

/// tcpdump on the container's host-side device, raw packets to a file.
struct LinkCapture {
    proc: Proc,
    file: PathBuf,
    err: PathBuf,
}

impl LinkCapture {
    fn start(env: &common::Env, dev: &str, dir: &Path) -> LinkCapture {
        let file = dir.join("link.pcap");
        let err = dir.join("tcpdump.err");
        let child = Command::new("ip")
            .args([
                "netns", "exec", &env.ns, "tcpdump", "-Z", "root", "-U", "-n", "-s", "0",
            ])
            .args(["--immediate-mode", "-i", dev, "-w"])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("tcpdump");
        let proc = Proc(child);
        // tcpdump says "listening on" once it captures.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("listening")
        {
            assert!(Instant::now() < deadline, "tcpdump did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        LinkCapture { proc, file, err }
    }

    /// Stops tcpdump with SIGINT (it drains what the kernel holds for it
    /// and writes it out) and returns the capture.
    fn bytes(mut self) -> Vec<u8> {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGINT) };
        let _ = self.proc.0.wait();
        let pcap = std::fs::read(&self.file).unwrap();
        println!(
            "capture: {} bytes; tcpdump: {}",
            pcap.len(),
            std::fs::read_to_string(&self.err)
                .unwrap_or_default()
                .trim()
        );
        pcap
    }
}

/// A container reaches an HTTPS API through an egress rule with a
/// credential it never sees; the rule's methods and paths hold; forged
/// names, another address, plain HTTP and a bad upstream certificate get
/// nothing; the secret appears nowhere but at the rule's verified host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_calls_an_api_with_a_credential_it_never_sees() {
    require_root!();
    let dir = std::env::temp_dir().join(format!("cube-gateway-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // api.test at .2 (its certificate); at .3 a server whose certificate
    // names other.test, where bad.test also points.
    certificates(&dir, &[("api", "api.test"), ("other", "other.test")]);
    let bundle = dir.join("ca.pem");
    let (env, world) = node(&[
        "--dns-upstream",
        "198.51.100.2",
        "--egress-trust-bundle",
        bundle.to_str().unwrap(),
    ]);
    world.run(|| {
        assert!(
            Command::new("ip")
                .args(["addr", "add", "198.51.100.3/24", "dev", "w0"])
                .status()
                .unwrap()
                .success()
        );
    });
    let _dns = common::dnsmasq::start(
        &world,
        &[
            "--address=/api.test/198.51.100.2".into(),
            "--address=/plain.test/198.51.100.2".into(),
            "--address=/bad.test/198.51.100.3".into(),
            "--local-ttl=1".into(),
        ],
        "api.test",
    );
    let (_api, api_log) = upstream(&world, &dir, "198.51.100.2", 443, Some("api"));
    let (_other, other_log) = upstream(&world, &dir, "198.51.100.3", 443, Some("other"));
    let (_plain, plain_log) = upstream(&world, &dir, "198.51.100.2", 80, None);

    let ctr = Ctr::new("gw");
    let id = "cni:c-gw:eth0";
    ctr::add(&env, "c-gw", &ctr, serde_json::json!({}));
    let _conf = ctr.resolv_conf("198.51.100.2");
    let c = env.client().await;

    // The node CA: the file, the D-Bus property and the varlink method
    // agree; the key is the owner's only.
    let state = env.dir.join("state");
    let ca_pem = std::fs::read_to_string(state.join("egress-ca.crt")).unwrap();
    assert!(
        ca_pem.starts_with("-----BEGIN CERTIFICATE-----"),
        "{ca_pem}"
    );
    let prop: String = c
        .conn
        .call_method(
            Some("org.cube.NetworkAgent"),
            "/org/cube/NetworkAgent",
            Some("org.freedesktop.DBus.Properties"),
            "Get",
            &("org.cube.NetworkAgent", "EgressCaCertificate"),
        )
        .await
        .unwrap()
        .body()
        .deserialize::<OwnedValue>()
        .unwrap()
        .try_into()
        .unwrap();
    assert_eq!(prop, ca_pem);
    use std::os::unix::fs::PermissionsExt;
    let key_mode = std::fs::metadata(state.join("egress-ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(key_mode & 0o777, 0o600);
    let cacert = state.join("egress-ca.crt");

    // Rules after ADD, by sandbox id (a conflist is no place for secrets).
    let rules = vec![
        rule("api.test", &[("Authorization", SECRET)], &["GET"], &["/v1"]),
        rule("bad.test", &[("Authorization", SECRET)], &[], &[]),
        {
            let mut r = rule("plain.test", &[("X-Api-Key", PLAIN_SECRET)], &[], &[]);
            r.insert("plain_http", Value::from(true));
            r
        },
    ];
    let net: HashMap<String, OwnedValue> = c.call("SetEgressRules", &(id, &rules)).await.unwrap();
    let shown = format!("{:?}", net["egress_rules"]);
    assert!(
        shown.contains("sha256:") && shown.contains("authorization"),
        "{shown}"
    );
    let dev = common::s(&net, "tap_name");
    let capture = LinkCapture::start(&env, &dev, &dir);

    let curl = |args: &str| {
        ctr.sh(&format!(
            "curl -sS --cacert {} --connect-timeout 3 --max-time 8 {args} 2>&1; echo \" rc=$?\"",
            cacert.display()
        ))
    };

    // 1. The upstream sees the rule's header, in place of the guest's own;
    // two requests on one kept-alive connection, each with it.
    let out = curl(
        "-H 'Authorization: guest-own' -H 'x-probe: p1' https://api.test/v1/models \
         https://api.test/v1/other",
    );
    assert!(
        out.contains("upstream GET /v1/models") && out.contains("upstream GET /v1/other"),
        "{out}"
    );
    assert!(
        out.contains("probe=p1") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let reqs = logged(&api_log);
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    for (_, _, h) in &reqs {
        assert_eq!(h.get("authorization").map(String::as_str), Some(SECRET));
    }

    // 1b. The clients platforms run: Python requests (with the node CA as
    // its bundle) and Node's fetch (NODE_EXTRA_CA_CERTS).
    let out = ctr.sh(&format!(
        "python3 -c 'import requests; r = requests.get(\"https://api.test/v1/py\", \
         headers={{\"x-probe\": \"py\"}}, verify=\"{}\", timeout=8); print(r.status_code, r.text)' 2>&1",
        cacert.display()
    ));
    assert!(
        out.starts_with("200 upstream GET /v1/py") && out.contains("probe=py"),
        "{out}"
    );
    let out = ctr.sh(&format!(
        "NODE_EXTRA_CA_CERTS={} timeout 10 node -e 'fetch(\"https://api.test/v1/node\", \
         {{headers: {{\"x-probe\": \"node\"}}}}).then(r => r.text()).then(t => \
         console.log(t.trim()), e => console.log(\"failed\", e.cause || e))' 2>&1",
        cacert.display()
    ));
    assert!(
        out.starts_with("upstream GET /v1/node") && out.contains("probe=node"),
        "{out}"
    );
    let reqs = logged(&api_log);
    assert_eq!(reqs.len(), 4, "{reqs:?}");
    for (_, _, h) in &reqs {
        assert_eq!(h.get("authorization").map(String::as_str), Some(SECRET));
    }

    // 1c. HTTP/2 (ALPN), each stream judged: curl speaks h2 to the
    // gateway, which sends the requests on to this HTTP/1.1 upstream.
    let out = curl(
        "--http2 -w ' %{http_version}' https://api.test/v1/h2a https://api.test/v1/h2b \
         -H 'x-probe: h2'",
    );
    assert!(
        out.contains("upstream GET /v1/h2a") && out.contains("upstream GET /v1/h2b"),
        "{out}"
    );
    assert!(
        out.contains(" 2") && out.ends_with(" rc=0\n"),
        "not HTTP/2: {out}"
    );
    let out =
        curl("--http2 -o /dev/null -w '%{http_code}' -H 'Host: other.test' https://api.test/v1/x");
    assert!(out.starts_with("421"), "{out}");
    let reqs = logged(&api_log);
    assert_eq!(reqs.len(), 6, "{reqs:?}");
    for (_, _, h) in &reqs {
        assert_eq!(h.get("authorization").map(String::as_str), Some(SECRET));
    }

    // 2. Methods and paths: POST, a path beside the prefix, dot segments.
    let out = curl("-X POST -d x=1 https://api.test/v1/models");
    assert!(
        out.contains("api.test") && !out.contains("upstream"),
        "{out}"
    );
    // A refused upload over HTTP/2: the answer arrives, not a stream reset
    // (the engine reads what is left of a refused request's body first).
    let out = ctr.sh(&format!(
        "head -c 200000 /dev/zero | curl -sS --http2 --cacert {} --max-time 8 -X POST \
         --data-binary @- -o /dev/null -w '%{{http_code}} %{{http_version}}' \
         https://api.test/v1/upload 2>&1; echo \" rc=$?\"",
        cacert.display()
    ));
    assert!(
        out.starts_with("403 2") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let out = curl("-o /dev/null -w '%{http_code}' https://api.test/v1x");
    assert!(out.starts_with("403"), "{out}");
    // (The engine refuses dot segments before any rule: 400.)
    let out = curl("--path-as-is -o /dev/null -w '%{http_code}' https://api.test/v1/../admin");
    assert!(out.starts_with("400") || out.starts_with("403"), "{out}");
    let out = curl("-o /dev/null -w '%{http_code}' -X POST https://api.test/v1");
    assert!(out.starts_with("403"), "{out}");
    assert_eq!(
        logged(&api_log).len(),
        6,
        "a refused request reached the upstream"
    );

    // 3. A Host that is not the SNI: 421, nothing sent; also the Host of
    // another rule's domain (bad.test) on a kept-alive connection whose
    // first request went through (curl --next reuses the connection).
    let out = curl("-o /dev/null -w '%{http_code}' -H 'Host: other.test' https://api.test/v1/x");
    assert!(out.starts_with("421"), "{out}");
    let out = curl(&format!(
        "-w ' %{{http_code}} %{{num_connects}}\\n' https://api.test/v1/ka --next \
         --cacert {} -o /dev/null -w '%{{http_code}} %{{num_connects}}\\n' \
         -H 'Host: bad.test' https://api.test/v1/kb",
        cacert.display()
    ));
    assert!(
        out.contains("upstream GET /v1/ka") && out.contains(" 200 1\n") && out.contains("421 0\n"),
        "the second request, on the same connection, is not 421: {out}"
    );
    assert_eq!(logged(&api_log).len(), 7);
    assert!(!logged(&api_log).iter().any(|r| r.1 == "/v1/kb"));

    // 4. The rule's name sent to another address (whose certificate is
    // for other.test): the agent verifies the name there, 502, nothing
    // sent. bad.test's upstream has the wrong certificate too.
    let out = curl(
        "-o /dev/null -w '%{http_code}' --resolve api.test:443:198.51.100.3 \
         https://api.test/v1/models",
    );
    assert!(out.starts_with("502"), "{out}");
    let out = curl("https://bad.test/");
    assert!(out.contains("502") || out.contains("certificate"), "{out}");
    assert!(logged(&other_log).is_empty(), "{:?}", logged(&other_log));

    // 5. An address as the URL (no SNI) and a host without a rule: spliced
    // to the address dialled, as without rules: no header added.
    let out = ctr.sh(
        "curl -sSk --connect-timeout 3 --max-time 8 https://198.51.100.2/v1/raw 2>&1; echo \" rc=$?\"",
    );
    assert!(
        out.contains("upstream GET /v1/raw") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let out = ctr.sh(
        "curl -sSk --connect-timeout 3 --max-time 8 --resolve norule.test:443:198.51.100.3 \
         https://norule.test/n 2>&1; echo \" rc=$?\"",
    );
    assert!(
        out.contains("upstream GET /n") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let reqs = logged(&api_log);
    let raw = reqs
        .iter()
        .find(|r| r.1 == "/v1/raw")
        .expect("the spliced request");
    assert!(!raw.2.contains_key("authorization"), "{raw:?}");
    let spliced = logged(&other_log);
    assert!(
        spliced.iter().all(|r| !r.2.contains_key("authorization")),
        "{spliced:?}"
    );

    // 5a. A redirect from the rule's host to another host: the client
    // follows it on a new connection, which gets that host's verdict (a
    // splice), never the rule's header.
    let before = logged(&other_log).len();
    let out = ctr.sh(&format!(
        "curl -sSkL --cacert {} --connect-timeout 3 --max-time 8 \
         --resolve norule.test:443:198.51.100.3 \
         'https://api.test/v1/redirect?to=https://norule.test/r' 2>&1; echo \" rc=$?\"",
        cacert.display()
    ));
    assert!(
        out.contains("upstream GET /r") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let after = logged(&other_log);
    assert_eq!(after.len(), before + 1, "{after:?}");
    assert!(!after[before].2.contains_key("authorization"), "{after:?}");

    // 5b. The node's own services are never the proxy's destination: a
    // server on the node (port 80 on every address, the uplink's
    // 198.51.100.1 among them) is what a splice to "the address dialled"
    // must not reach (the datapath drops such packets of a sandbox without
    // rules, node_addr). Without the check, this request reached it.
    let (_node, node_log) = upstream_in(&env.ns, &dir, "0.0.0.0", 80, None);
    let out = ctr.sh(
        "curl -sS --connect-timeout 3 --max-time 5 http://198.51.100.1/node 2>&1; echo \" rc=$?\"",
    );
    assert!(
        !out.contains("upstream") && !out.ends_with(" rc=0\n"),
        "{out}"
    );
    assert!(logged(&node_log).is_empty(), "{:?}", logged(&node_log));

    // 6. Plain HTTP to a rule's host without plain_http: 403, never
    // spliced; with plain_http: intercepted, the agent dials the name.
    let out =
        ctr.sh("curl -sS -o /dev/null -w '%{http_code}' --max-time 8 http://api.test/v1/models");
    assert!(out.starts_with("403"), "{out}");
    let out = ctr.sh("curl -sS --max-time 8 -H 'x-probe: pl' http://plain.test/p 2>&1");
    assert!(
        out.contains("upstream GET /p") && out.contains("probe=pl"),
        "{out}"
    );
    let reqs = logged(&plain_log);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(
        reqs[0].2.get("x-api-key").map(String::as_str),
        Some(PLAIN_SECRET)
    );

    // Nothing that crossed the container's link carries a secret (the
    // plain HTTP request above went out without it and came back without
    // it), nor does any view, log or error.
    let pcap = capture.bytes();
    assert!(
        pcap.len() > 1000,
        "the capture saw the traffic: {} bytes",
        pcap.len()
    );
    assert!(
        contains(&pcap, "upstream GET /p"),
        "the capture sees plain HTTP"
    );
    for s in [SECRET, PLAIN_SECRET] {
        assert!(!contains(&pcap, s), "{s} crossed the container's link");
    }
    let net = c.get(id).await.unwrap();
    let list: Vec<HashMap<String, OwnedValue>> = c.call("ListNetworks", &()).await.unwrap();
    let views = format!("{net:?} {list:?}");
    let over_varlink = varlink(
        &env,
        serde_json::json!({"method": "org.cube.NetworkAgent.GetNetwork",
                           "parameters": {"sandbox_id": id}}),
    );
    assert!(over_varlink.contains("sha256:"), "{over_varlink}");
    let ca_varlink = varlink(
        &env,
        serde_json::json!({"method": "org.cube.NetworkAgent.GetEgressCA"}),
    );
    let ca_varlink: serde_json::Value = serde_json::from_str(&ca_varlink).unwrap();
    assert_eq!(ca_varlink["parameters"]["certificate"], ca_pem.as_str());
    let views = format!("{views} {over_varlink}");
    let log = env.log();
    assert!(
        log.contains("egress: cni:c-gw:eth0 GET api.test/v1/models 200"),
        "no audit line:\n{log}"
    );
    assert!(log.contains("403"), "the refusals are logged too");
    for s in [SECRET, PLAIN_SECRET, "sk-live", "51c0de"] {
        assert!(!views.contains(s), "{s} in a view: {views}");
        assert!(!log.contains(s), "{s} in the agent's log");
    }

    // Counted per sandbox: 9 requests sent on (two kept-alive, two over
    // HTTP/2, Python's, Node's, the kept-alive one before another rule's
    // Host, the redirect, one plain HTTP); 11 refused (the other Host over
    // HTTP/2, POST, the upload over HTTP/2, /v1x, the dot segments, POST /v1, the other Host,
    // another rule's Host on a kept-alive connection, the two 502s, plain
    // HTTP without plain_http).
    let t = c.traffic(id).await;
    assert_eq!(
        (t["egress_requests"], t["egress_refused"]),
        (9, 11),
        "{t:?}"
    );

    // Bad input changes nothing and names the field, never the value.
    let bad = vec![rule("api.test", &[("X-Key", "v\r\nX-Evil: 1")], &[], &[])];
    let e = c
        .call::<_, HashMap<String, OwnedValue>>("SetEgressRules", &(id, &bad))
        .await
        .unwrap_err();
    assert!(
        e.message.contains("rules[0].set_headers[X-Key]") || e.message.contains("set_headers"),
        "{e:?}"
    );
    assert!(!e.message.contains("X-Evil"), "{e:?}");
    for n in [65, 10_000] {
        let many: Vec<Rule> = (0..n).map(|_| rule("api.test", &[], &[], &[])).collect();
        let e = c
            .call::<_, HashMap<String, OwnedValue>>("SetEgressRules", &(id, &many))
            .await
            .unwrap_err();
        assert!(e.message.contains("limit is 64"), "{e:?}");
    }
    let long = "k".repeat(5000);
    let long: &'static str = Box::leak(long.into_boxed_str());
    for (bad, field) in [
        (rule("", &[], &[], &[]), "rules[0].host: empty"),
        (rule("api.test", &[("X:Key", "v")], &[], &[]), "set_headers"),
        (rule("api.test", &[("X-Key", long)], &[], &[]), "4096"),
        (rule("api.test", &[], &["GE T"], &[]), "methods"),
        (rule("api.test", &[], &[], &["v1"]), "paths"),
        (rule("10.0.0.1", &[], &[], &[]), "host"),
    ] {
        let e = c
            .call::<_, HashMap<String, OwnedValue>>("SetEgressRules", &(id, &vec![bad]))
            .await
            .unwrap_err();
        assert!(
            e.name.ends_with("InvalidArgument") && e.message.contains(field),
            "{field}: {e:?}"
        );
        assert!(!e.message.contains("kkkk"), "{e:?}");
    }
    let after = c.get(id).await.unwrap();
    assert_eq!(
        format!("{:?}", after["egress_rules"]),
        format!("{:?}", net["egress_rules"])
    );

    // The store keeps the secret, readable by its owner only.
    for f in std::fs::read_dir(&state).unwrap() {
        let p = f.unwrap().path();
        if p.is_file() && std::fs::read(&p).is_ok_and(|b| contains(&b, SECRET)) {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode();
            assert_eq!(
                mode & 0o077,
                0,
                "{} holds a secret with mode {mode:o}",
                p.display()
            );
        }
    }

    // Rules and CA survive a restart; the next request still gets the header.
    let mut env = env;
    env.kill_agent();
    env.start_agent();
    assert_eq!(
        std::fs::read_to_string(state.join("egress-ca.crt")).unwrap(),
        ca_pem
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = curl("https://api.test/v1/again");
        if out.contains("upstream GET /v1/again") {
            break;
        }
        assert!(Instant::now() < deadline, "after a restart: {out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let reqs = logged(&api_log);
    let again = reqs.iter().find(|r| r.1 == "/v1/again").unwrap();
    assert_eq!(
        again.2.get("authorization").map(String::as_str),
        Some(SECRET)
    );

    // Rules removed: the host is spliced again, no header.
    let none: Vec<Rule> = vec![];
    let c = env.client().await;
    let _: HashMap<String, OwnedValue> = c.call("SetEgressRules", &(id, &none)).await.unwrap();
    let out = ctr.sh(
        "curl -sSk --connect-timeout 3 --max-time 8 https://api.test/v1/after 2>&1; echo \" rc=$?\"",
    );
    assert!(out.contains("upstream GET /v1/after"), "{out}");
    let reqs = logged(&api_log);
    let after = reqs.iter().find(|r| r.1 == "/v1/after").unwrap();
    assert!(!after.2.contains_key("authorization"), "{after:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real client's kept-alive connection (Python's http.client) while the
/// rules change: each request is judged by the rule of its moment (a new
/// header value applies to the next request on the same connection), and
/// removing the host's rule closes the connection, so the old secret never
/// goes out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_change_under_a_kept_alive_connection() {
    require_root!();
    let dir = std::env::temp_dir().join(format!("cube-gateway-ka-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir, &[("api", "api.test")]);
    let bundle = dir.join("ca.pem");
    let (env, world) = node(&[
        "--dns-upstream",
        "198.51.100.2",
        "--egress-trust-bundle",
        bundle.to_str().unwrap(),
    ]);
    let _dns = common::dnsmasq::start(
        &world,
        &["--address=/api.test/198.51.100.2".into()],
        "api.test",
    );
    let (_api, api_log) = upstream(&world, &dir, "198.51.100.2", 443, Some("api"));
    let ctr = Ctr::new("gwka");
    let id = "cni:c-gwka:eth0";
    ctr::add(&env, "c-gwka", &ctr, serde_json::json!({}));
    let _conf = ctr.resolv_conf("198.51.100.2");
    let c = env.client().await;
    let set = |value: Option<&'static str>| {
        let c = &c;
        async move {
            let rules: Vec<Rule> = value
                .map(|v| rule("api.test", &[("Authorization", v)], &[], &[]))
                .into_iter()
                .collect();
            let _: HashMap<String, OwnedValue> =
                c.call("SetEgressRules", &(id, &rules)).await.unwrap();
        }
    };
    set(Some("Bearer first-7c1")).await;

    let cacert = env.dir.join("state/egress-ca.crt");
    let script = format!(
        r#"
import http.client, ssl, sys
ctx = ssl.create_default_context(cafile="{}")
c = http.client.HTTPSConnection("api.test", 443, context=ctx, timeout=5)
for path in ["/v1/one", "/v1/two", "/v1/three"]:
    try:
        c.request("GET", path)
        r = c.getresponse()
        print(r.status, r.read().decode().strip(), flush=True)
    except Exception as e:
        print("closed", type(e).__name__, flush=True)
        break
    sys.stdin.readline()
"#,
        cacert.display()
    );
    let mut py = Command::new("ip")
        .args(["netns", "exec", &ctr.name, "python3", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = py.stdin.take().unwrap();
    let mut lines = BufReader::new(py.stdout.take().unwrap()).lines();
    let mut next = || lines.next().unwrap().unwrap();
    use std::io::Write;

    let one = next();
    assert!(one.starts_with("200 upstream GET /v1/one"), "{one}");
    // A new value: the next request on the same connection carries it.
    set(Some("Bearer second-9d2")).await;
    stdin.write_all(b"\n").unwrap();
    let two = next();
    assert!(two.starts_with("200 upstream GET /v1/two"), "{two}");
    let reqs = logged(&api_log);
    let (first, second) = (&reqs[0].2, &reqs[1].2);
    assert_eq!(
        first.get("authorization").map(String::as_str),
        Some("Bearer first-7c1")
    );
    assert_eq!(
        second.get("authorization").map(String::as_str),
        Some("Bearer second-9d2")
    );
    assert_eq!(
        first[":peer"], second[":peer"],
        "not the same kept-alive connection"
    );

    // The host's rule removed: the connection is closed; the old secret
    // never goes out again.
    set(None).await;
    std::thread::sleep(Duration::from_millis(300));
    stdin.write_all(b"\n").unwrap();
    let three = next();
    let reqs = logged(&api_log);
    let third = reqs.iter().find(|r| r.1 == "/v1/three");
    println!("after the rule was removed: {three} (upstream saw: {third:?})");
    assert!(
        third.is_none_or(|r| !r.2.contains_key("authorization")),
        "{third:?}"
    );
    assert!(three.starts_with("closed"), "{three}");
    drop(stdin);
    let _ = py.wait();

    // A release ends an intercepted connection too: nothing of it reaches
    // the upstream (nor the address's next owner) afterwards.
    set(Some("Bearer third-4e8")).await;
    let mut py = Command::new("ip")
        .args(["netns", "exec", &ctr.name, "python3", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = py.stdin.take().unwrap();
    let mut lines = BufReader::new(py.stdout.take().unwrap()).lines();
    let one = lines.next().unwrap().unwrap();
    assert!(one.starts_with("200 upstream GET /v1/one"), "{one}");
    assert!(c.release(id).await.unwrap());
    std::thread::sleep(Duration::from_millis(300));
    stdin.write_all(b"\n").unwrap();
    let two = lines.next().unwrap().unwrap();
    assert!(two.starts_with("closed"), "after the release: {two}");
    let reqs = logged(&api_log);
    assert_eq!(
        reqs.iter()
            .filter(|r| r.2.get("authorization").map(String::as_str) == Some("Bearer third-4e8"))
            .count(),
        1,
        "{reqs:?}"
    );
    drop(stdin);
    let _ = py.wait();
    let log = env.log();
    assert!(log.contains("intercepted connection closed"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Over IPv6 as over IPv4: a ruled sandbox's HTTPS to a rule's host at an
/// IPv6 address is steered to the proxy (guest6_steer) and intercepted,
/// the agent connecting to the address the guest dialled over IPv6 and
/// verifying the name there; a host without a rule is spliced there with
/// no header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_rules_over_ipv6() {
    require_root!();
    use common::world::{WORLD_IP6, World};
    let dir = std::env::temp_dir().join(format!("cube-gateway-v6-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir, &[("api6", "api6.test"), ("plain6", "norule6.test")]);
    let bundle = dir.join("ca.pem");
    let mut env = common::Env::new(&[
        "--dns-upstream",
        "198.51.100.2",
        "--egress-trust-bundle",
        bundle.to_str().unwrap(),
    ]);
    let world = World::attach(&env);
    world.add_ipv6(&[]);
    env.kill_agent();
    env.start_agent();
    let _dns = common::dnsmasq::start(
        &world,
        &[
            "--address=/probe.test/198.51.100.2".into(),
            format!("--host-record=api6.test,{WORLD_IP6}"),
            format!("--host-record=norule6.test,{WORLD_IP6}"),
        ],
        "probe.test",
    );
    let (_api, api_log) = upstream(&world, &dir, &WORLD_IP6.to_string(), 443, Some("api6"));
    let ctr = Ctr::new("gw6");
    let id = "cni:c-gw6:eth0";
    ctr::add(&env, "c-gw6", &ctr, serde_json::json!({}));
    let _conf = ctr.resolv_conf("198.51.100.2");
    let c = env.client().await;
    let rules = vec![rule("api6.test", &[("Authorization", SECRET)], &[], &[])];
    let net: HashMap<String, OwnedValue> = c.call("SetEgressRules", &(id, &rules)).await.unwrap();
    assert!(
        bool::try_from(net["ipv6_egress"].try_clone().unwrap()).unwrap(),
        "the sandbox has IPv6 egress"
    );
    // The container's IPv6 address and default route (router advertisement).
    let deadline = Instant::now() + Duration::from_secs(10);
    while ctr
        .ip_json(&["-6", "route", "show", "default"])
        .as_array()
        .is_none_or(|r| r.is_empty())
    {
        assert!(Instant::now() < deadline, "no IPv6 default route");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let cacert = env.dir.join("state/egress-ca.crt");
    let out = ctr.sh(&format!(
        "curl -6 -sS --cacert {} --connect-timeout 3 --max-time 8 -H 'x-probe: v6' \
         https://api6.test/v1/six 2>&1; echo \" rc=$?\"",
        cacert.display()
    ));
    assert!(
        out.contains("upstream GET /v1/six") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    // A host without a rule at the same address: spliced, no header (its
    // certificate names api6.test: -k).
    let out = ctr.sh(
        "curl -6 -sSk --connect-timeout 3 --max-time 8 https://norule6.test/n6 2>&1; \
         echo \" rc=$?\"",
    );
    assert!(
        out.contains("upstream GET /n6") && out.ends_with(" rc=0\n"),
        "{out}"
    );
    let reqs = logged(&api_log);
    let six = reqs
        .iter()
        .find(|r| r.1 == "/v1/six")
        .expect("the intercepted request");
    assert_eq!(six.2.get("authorization").map(String::as_str), Some(SECRET));
    let n6 = reqs
        .iter()
        .find(|r| r.1 == "/n6")
        .expect("the spliced request");
    assert!(!n6.2.contains_key("authorization"), "{n6:?}");
    // Both came from the node over IPv6 (the proxy's connections).
    for r in [six, n6] {
        assert!(r.2[":peer"].contains(':'), "not over IPv6: {r:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Health's `egress_proxy` follows the gateway: with a trust bundle that
/// cannot be read the gateway does not run, which is no fault while no
/// sandbox has rules and false (naming why) once one has; GetEgressCA
/// then fails instead of answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_when_the_gateway_cannot_run() {
    require_root!();
    let (env, _world) = node(&[
        "--dns-upstream",
        "198.51.100.2",
        "--egress-trust-bundle",
        "/nonexistent/bundle.pem",
    ]);
    let c = env.client().await;
    let proxy = |checks: &[(String, bool, String)]| common::check(checks, "egress_proxy").clone();
    let (_, checks) = c.health().await;
    let before = proxy(&checks);
    assert!(before.1, "no sandbox with rules yet: {before:?}");
    let rules = vec![rule("api.test", &[("Authorization", SECRET)], &[], &[])];
    let o = common::opts(vec![("egress_rules", Value::from(rules))]);
    c.ensure("ruled", o).await.unwrap();
    let (_, checks) = c.health().await;
    let after = proxy(&checks);
    assert!(
        !after.1 && after.2.contains("egress gateway") && after.2.contains("bundle.pem"),
        "{after:?}"
    );
    assert!(!after.2.contains(SECRET));
    let ca = varlink(
        &env,
        serde_json::json!({"method": "org.cube.NetworkAgent.GetEgressCA"}),
    );
    assert!(ca.contains("error") && ca.contains("does not run"), "{ca}");
    assert!(c.release("ruled").await.unwrap());
    let (_, checks) = c.health().await;
    assert!(proxy(&checks).1, "{:?}", proxy(&checks));
}
