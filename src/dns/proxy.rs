//! Strict egress (`egress_mode` "sni", docs/egress.md): a strict-mode
//! sandbox's TCP to ports 80 and 443 arrives here (the datapath sends it
//! to the gateway-device address, ports `DP_PROXY_HTTP_PORT` and
//! `DP_PROXY_TLS_PORT`, and sends the replies back from the address the
//! guest dialled). The proxy reads the TLS ClientHello's server name or
//! the HTTP request's Host, checks it against the sandbox's patterns,
//! resolves it itself (only addresses a DNS answer would teach the
//! datapath: never loopback, link-local, the node's or the pool's, private
//! ones only under an allow CIDR), connects to it and splices. Anything else is reset at once.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use super::intercept::{AuditRecord, Interceptor, Judge, Judgement};
use super::{Passed, Shares, TYPE_A, adopt_or_bind, answer_addrs, encode_query, forward, rand_id};
use crate::datapath::maps::{DP_PROXY_HTTP_PORT, DP_PROXY_TLS_PORT};
use crate::policy::{EgressPolicy, ProxyDecision};

/// The most a client may send before it names the host (a ClientHello
/// across records, or an HTTP request head).
pub const MAX_HELLO: usize = 16 * 1024;
/// How long a client has to send that.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A spliced connection on which nothing moved either way for this long
/// is reset (it would hold one of its sandbox's connection slots).
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Connections at once per sandbox (in all: `policy::MAX_CONNS`; fewer
/// when many sandboxes hold connections: see `Shares`).
const MAX_CONNS_PER_SOURCE: usize = 64;

/// What the first bytes of a connection named.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// Not enough bytes yet: at least this many more are needed.
    More(usize),
    /// The name (lowercase, no trailing dot), or `None` when the client
    /// named none that can be dialled (no SNI, an address, garbage).
    Done(Option<String>),
}

/// A host name as the patterns take it, or `None` for an address or a
/// malformed name.
fn host_name(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        && s.parse::<Ipv4Addr>().is_err()
        && !s.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    ok.then_some(s)
}

/// The server name of a TLS ClientHello (records of type handshake,
/// possibly several), RFC 8446 4.1.2 and RFC 6066 3.
pub fn tls_server_name(buf: &[u8]) -> Hello {
    // The handshake bytes, across records, up to the first record of
    // another type (a client may send early data right behind).
    let mut hs = Vec::new();
    let mut at = 0;
    let mut other = false;
    while at + 5 <= buf.len() {
        if buf[at] != 22 {
            other = true;
            break;
        }
        let len = usize::from(u16::from_be_bytes([buf[at + 3], buf[at + 4]]));
        if at + 5 + len > buf.len() {
            break;
        }
        hs.extend_from_slice(&buf[at + 5..at + 5 + len]);
        at += 5 + len;
    }
    if buf.first().is_some_and(|&t| t != 22) {
        return Hello::Done(None);
    }
    // Handshake bytes already in the buffer in a record not complete yet.
    let partial = if other {
        0
    } else {
        buf.len().saturating_sub(at + 5)
    };
    // Incomplete (`missing` handshake bytes, when known): each needs a
    // byte more in the buffer; none can follow another record type.
    let incomplete = |missing: usize| {
        if other {
            Hello::Done(None)
        } else {
            Hello::More(missing.saturating_sub(partial).max(1))
        }
    };
    if hs.len() < 4 {
        return incomplete(0);
    }
    if hs[0] != 1 {
        return Hello::Done(None); // not a ClientHello
    }
    let body_len = (usize::from(hs[1]) << 16) | (usize::from(hs[2]) << 8) | usize::from(hs[3]);
    if body_len + 4 > MAX_HELLO {
        return Hello::Done(None);
    }
    if hs.len() < 4 + body_len {
        return incomplete(4 + body_len - hs.len());
    }
    Hello::Done(client_hello_sni(&hs[4..4 + body_len]))
}

fn client_hello_sni(b: &[u8]) -> Option<String> {
    let u16_at = |at: usize| -> Option<usize> {
        Some(usize::from(u16::from_be_bytes([
            *b.get(at)?,
            *b.get(at + 1)?,
        ])))
    };
    // version, random
    let mut at = 2 + 32;
    at += 1 + usize::from(*b.get(at)?); // session id
    at += 2 + u16_at(at)?; // cipher suites
    at += 1 + usize::from(*b.get(at)?); // compression methods
    let ext_end = at + 2 + u16_at(at)?;
    at += 2;
    if ext_end > b.len() {
        return None;
    }
    while at + 4 <= ext_end {
        let (kind, len) = (u16_at(at)?, u16_at(at + 2)?);
        at += 4;
        if at + len > ext_end {
            return None;
        }
        if kind == 0 {
            // server_name: a list of (type, name); host_name is type 0.
            let list = b.get(at..at + len)?;
            let mut i = 2;
            while i + 3 <= list.len() {
                let n = usize::from(u16::from_be_bytes([list[i + 1], list[i + 2]]));
                let name = list.get(i + 3..i + 3 + n)?;
                if list[i] == 0 {
                    return host_name(name);
                }
                i += 3 + n;
            }
            return None;
        }
        at += len;
    }
    None
}

/// The Host of an HTTP/1 request head (RFC 9112 3.2), without its port.
/// A CONNECT, or a request whose absolute-form target names another host
/// than Host (a server takes the target's), names none.
pub fn http_host(buf: &[u8]) -> Hello {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() >= MAX_HELLO {
            Hello::Done(None)
        } else {
            Hello::More(1)
        };
    };
    let head = &buf[..end];
    let line = head.split(|&c| c == b'\n').next().unwrap_or_default();
    let mut words = line.split(|&c| c == b' ');
    let (method, target) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    if method.eq_ignore_ascii_case(b"CONNECT") {
        return Hello::Done(None);
    }
    let lower = target.to_ascii_lowercase();
    let absolute = lower
        .strip_prefix(b"http://")
        .or_else(|| lower.strip_prefix(b"https://"))
        .map(|rest| {
            let authority = rest
                .split(|&c| c == b'/' || c == b'?')
                .next()
                .unwrap_or_default();
            let authority = authority.rsplit(|&c| c == b'@').next().unwrap_or_default();
            strip_port(authority).to_vec()
        });
    let mut hosts = head.split(|&c| c == b'\n').skip(1).filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|&c| c == b':')?;
        line[..colon]
            .eq_ignore_ascii_case(b"host")
            .then(|| line[colon + 1..].trim_ascii())
    });
    let (Some(host), None) = (hosts.next(), hosts.next()) else {
        return Hello::Done(None); // none, or two (which one would the server take?)
    };
    let name = host_name(strip_port(host));
    match absolute {
        Some(target) if host_name(&target) != name => Hello::Done(None),
        _ => Hello::Done(name),
    }
}

/// `host[:port]` without the port.
fn strip_port(host: &[u8]) -> &[u8] {
    match host.iter().rposition(|&c| c == b':') {
        Some(i) if host[i + 1..].iter().all(u8::is_ascii_digit) => &host[..i],
        _ => host,
    }
}

/// Binds both ports on the gateway-device address and serves them; the
/// outcome goes to Health (`egress_proxy`).
pub fn serve(
    agent: Arc<impl EgressPolicy>,
    upstream: Option<SocketAddrV4>,
    gateway: Option<Arc<Interceptor>>,
    passed: &mut Passed,
) -> std::io::Result<()> {
    let addresses = super::service_addresses(&*agent);
    let bound = (|| {
        let mut listeners = vec![];
        for (ip, suffix) in &addresses {
            for (port, dial, name) in [
                (DP_PROXY_TLS_PORT, 443, "proxy-tls"),
                (DP_PROXY_HTTP_PORT, 80, "proxy-http"),
            ] {
                let at = SocketAddr::new(*ip, port);
                let l = adopt_or_bind(passed, &format!("{name}{suffix}"), at, false)
                    .map_err(|e| std::io::Error::new(e.kind(), format!("binding {at}: {e}")))?;
                let l = std::net::TcpListener::from(l);
                l.set_nonblocking(true)?;
                listeners.push((TcpListener::from_std(l)?, dial));
            }
        }
        Ok::<_, std::io::Error>(listeners)
    })();
    let at = addresses
        .iter()
        .map(|(ip, _)| {
            format!(
                "{} (TLS), {} (HTTP)",
                SocketAddr::new(*ip, DP_PROXY_TLS_PORT),
                SocketAddr::new(*ip, DP_PROXY_HTTP_PORT)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let ip = agent.resolver_address();
    // Ports below this one need privilege to bind: ours must.
    let unprivileged = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse::<u16>().ok())
        .unwrap_or(1024);
    let warning = if unprivileged <= DP_PROXY_TLS_PORT.max(DP_PROXY_HTTP_PORT) {
        let w = format!(
            " (warning: net.ipv4.ip_unprivileged_port_start is {unprivileged}: any local user \
             could bind these ports while the agent is down)"
        );
        warn!("proxy:{w}");
        w
    } else {
        String::new()
    };
    agent.proxy_status(match (&bound, upstream) {
        (Ok(_), Some(_)) => Ok(format!("listening on {at}{warning}")),
        (Ok(_), None) => Err(format!(
            "listening on {at}, but no upstream to resolve names (dns_upstream)"
        )),
        (Err(e), _) => Err(e.to_string()),
    });
    let listeners = bound?;
    info!(address = %ip, "proxy: strict egress on ports {DP_PROXY_TLS_PORT} and {DP_PROXY_HTTP_PORT}");
    let shares = Shares::new(agent.socket_caps().proxy, MAX_CONNS_PER_SOURCE);
    for (listener, dial_port) in listeners {
        let (agent, shares, gateway) = (agent.clone(), shares.clone(), gateway.clone());
        tokio::spawn(async move {
            loop {
                let (conn, from) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        debug!(error = %e, "proxy: accepting");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let from = agent.sandbox_source(from.ip());
                // Beyond its share (or with every slot taken): reset at
                // once, never a wait.
                // Strangers (reset in `relay`) share one source's slots.
                let source = if agent.proxy_serves(from) {
                    from
                } else {
                    Ipv4Addr::UNSPECIFIED
                };
                let Some(held) = shares.try_take(source) else {
                    reset(conn);
                    continue;
                };
                let (agent, gateway) = (agent.clone(), gateway.clone());
                tokio::spawn(async move {
                    relay(&agent, upstream, gateway, conn, from, dial_port).await;
                    drop(held);
                });
            }
        });
    }
    Ok(())
}

/// Closes with an RST (SO_LINGER 0), which the guest sees at once.
fn reset(conn: TcpStream) {
    let _ = conn.set_zero_linger();
    drop(conn);
}

/// Reads until the client named its host (or `None`: it named none, sent
/// too much, or took too long). Each parse waits for at least the bytes
/// the last one said are missing, and the HTTP head's end is searched in
/// new bytes only: a client trickling bytes costs linear work.
async fn read_hello(conn: &mut TcpStream, buf: &mut Vec<u8>, tls: bool) -> Option<String> {
    let mut parse_at = 1;
    let mut scanned: usize = 0;
    tokio::time::timeout(HELLO_TIMEOUT, async {
        loop {
            let ready = if tls {
                buf.len() >= parse_at
            } else {
                let from = scanned.saturating_sub(3);
                scanned = buf.len();
                buf[from..].windows(4).any(|w| w == b"\r\n\r\n") || buf.len() >= MAX_HELLO
            };
            if ready {
                let hello = if tls {
                    tls_server_name(buf)
                } else {
                    http_host(buf)
                };
                match hello {
                    Hello::Done(name) => return name,
                    Hello::More(n) => parse_at = buf.len() + n.max(1),
                }
            }
            if buf.len() >= MAX_HELLO {
                return None;
            }
            let mut chunk = [0u8; 4096];
            let room = (MAX_HELLO - buf.len()).min(chunk.len());
            match conn.read(&mut chunk[..room]).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .unwrap_or(None)
}

async fn relay<A: EgressPolicy>(
    agent: &Arc<A>,
    upstream: Option<SocketAddrV4>,
    gateway: Option<Arc<Interceptor>>,
    mut conn: TcpStream,
    src: Ipv4Addr,
    dial_port: u16,
) {
    // A stranger (not a sandbox the proxy serves) is reset before it sends.
    if !agent.proxy_serves(src) {
        reset(conn);
        return;
    }
    let tls = dial_port == 443;
    let mut buf = Vec::with_capacity(1024);
    let named = read_hello(&mut conn, &mut buf, tls).await;
    match agent.proxy_decide(src, named.as_deref(), tls) {
        ProxyDecision::Dial {
            sandbox_id,
            cidrs,
            changed,
        } => {
            let name = named.unwrap_or_default();
            dial_name(
                &**agent, upstream, conn, buf, src, dial_port, sandbox_id, name, cidrs, changed,
            )
            .await
        }
        ProxyDecision::Stranger | ProxyDecision::Refuse { .. } => reset(conn),
        // The entry to watch comes with the policy's verdict on the address.
        ProxyDecision::Splice { sandbox_id, .. } => {
            splice_dialled(&**agent, conn, buf, src, sandbox_id).await
        }
        ProxyDecision::PlainRefused {
            sandbox_id,
            rule_host,
        } => {
            agent.egress_request(src, &sandbox_id, false);
            info!(
                sandbox_id,
                host = named.as_deref().unwrap_or_default(),
                rule = rule_host,
                "egress: plain HTTP to a rule's host refused (403): the rule has no plain_http"
            );
            let body = format!(
                "plain HTTP to {rule_host} is refused by the sandbox's egress rule; use https\n"
            );
            refuse_http(conn, 403, "Forbidden", &body).await;
        }
        ProxyDecision::Intercept {
            sandbox_id,
            rule_host,
            changed,
        } => {
            let name = named.unwrap_or_default();
            match gateway {
                Some(g) => {
                    intercept(
                        agent, &g, upstream, conn, buf, src, tls, sandbox_id, name, rule_host,
                        changed,
                    )
                    .await
                }
                None => {
                    warn!(
                        sandbox_id,
                        host = name,
                        "egress: a rule's host, but the egress gateway is not running (see \
                         Health's egress_proxy); reset"
                    );
                    reset(conn)
                }
            }
        }
    }
}

/// Answers an HTTP status with a short text body and closes.
async fn refuse_http(mut conn: TcpStream, code: u16, reason: &str, body: &str) {
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(CONNECT_TIMEOUT, async {
        conn.write_all(head.as_bytes()).await?;
        conn.write_all(body.as_bytes()).await?;
        conn.shutdown().await
    })
    .await;
}

/// Connects to `dst` for the sandbox at `src` (its traffic class as the
/// socket's priority), telling the core how it went.
async fn connect_for(
    agent: &impl EgressPolicy,
    src: Ipv4Addr,
    dst: SocketAddr,
    sandbox_id: &str,
) -> Option<TcpStream> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(dst)).await {
        Ok(Ok(out)) => {
            agent.proxy_dialled(false);
            let _ = out.set_nodelay(true);
            if let Some(class) = agent.proxy_priority(src) {
                set_priority(&out, class);
            }
            Some(out)
        }
        Ok(Err(e)) => {
            // A cgroup IP filter (systemd's IPAddressDeny=) says EPERM.
            agent.proxy_dialled(e.raw_os_error() == Some(libc::EPERM));
            debug!(sandbox_id, %dst, error = %e, "proxy: cannot connect; reset");
            None
        }
        Err(_) => {
            debug!(sandbox_id, %dst, "proxy: connecting timed out; reset");
            None
        }
    }
}

/// The address the guest dialled for this connection, if the datapath
/// recorded it and the sandbox's policy lets it out (with the entry to
/// watch).
fn dialled(
    agent: &impl EgressPolicy,
    conn: &TcpStream,
    src: Ipv4Addr,
    sandbox_id: &str,
) -> Option<(SocketAddr, tokio::sync::watch::Receiver<()>)> {
    let dst = agent.proxy_peer(conn.local_addr().ok()?, conn.peer_addr().ok()?)?;
    let changed = agent.splice_still(src, sandbox_id, dst.ip())?;
    Some((dst, changed))
}

/// Egress rules, a host without a rule: to the address the guest dialled,
/// as it would have gone without rules.
async fn splice_dialled(
    agent: &impl EgressPolicy,
    conn: TcpStream,
    buf: Vec<u8>,
    src: Ipv4Addr,
    sandbox_id: String,
) {
    let Some((dst, changed)) = dialled(agent, &conn, src, &sandbox_id) else {
        debug!(
            sandbox_id,
            "proxy: no dialled address the sandbox may reach; reset"
        );
        return reset(conn);
    };
    let Some(out) = connect_for(agent, src, dst, &sandbox_id).await else {
        return reset(conn);
    };
    let still = || agent.splice_still(src, &sandbox_id, dst.ip());
    if send_and_splice(conn, out, &buf, changed, still).await {
        info!(
            sandbox_id,
            %dst, "proxy: connection reset: idle, or the sandbox's rules changed or it is gone"
        );
    }
}

/// Sends what the client sent so far, then splices until either side
/// closes, nothing moves for `IDLE_TIMEOUT`, or `still` (asked whenever
/// the sandbox's entry changed) says the connection may not go on: then
/// the client's side is reset and true returned. A connection never
/// outlives its sandbox's rules.
async fn send_and_splice(
    mut conn: TcpStream,
    mut out: TcpStream,
    buf: &[u8],
    mut changed: tokio::sync::watch::Receiver<()>,
    still: impl Fn() -> Option<tokio::sync::watch::Receiver<()>>,
) -> bool {
    let _ = conn.set_nodelay(true);
    if out.write_all(buf).await.is_err() {
        reset(conn);
        return false;
    }
    let cut = async {
        loop {
            if changed.changed().await.is_err() {
                match still() {
                    Some(next) => changed = next,
                    None => return,
                }
            }
        }
    };
    let was_cut = tokio::select! {
        idle = splice(&mut conn, &mut out, IDLE_TIMEOUT) => idle,
        () = cut => true,
    };
    if was_cut {
        drop(out);
        reset(conn);
    }
    was_cut
}

/// Egress rules, a rule's host: intercepted (`dns::intercept`). The
/// upstream is, over TLS, the address the guest dialled (which the
/// datapath's policy let out; the certificate must name the host); over
/// plain HTTP (a rule with `plain_http`), the rule's host resolved by the
/// agent, never the address the guest dialled. The connection ends when
/// the sandbox's rules no longer name the host, or it is released; each
/// request is judged by the rule of its moment.
#[allow(clippy::too_many_arguments)]
async fn intercept<A: EgressPolicy>(
    agent: &Arc<A>,
    gateway: &Interceptor,
    upstream: Option<SocketAddrV4>,
    conn: TcpStream,
    buf: Vec<u8>,
    src: Ipv4Addr,
    tls: bool,
    sandbox_id: String,
    name: String,
    rule_host: String,
    mut changed: tokio::sync::watch::Receiver<()>,
) {
    let dst = if tls {
        dialled(&**agent, &conn, src, &sandbox_id).map(|(d, _)| d)
    } else {
        resolve_for(&**agent, upstream, src, &sandbox_id, &name, None)
            .await
            .map(|ip| SocketAddr::from((ip, 80)))
    };
    let Some(dst) = dst else {
        info!(
            sandbox_id,
            host = name,
            "egress: no address of the rule's host the sandbox may reach; reset"
        );
        return reset(conn);
    };
    let Some(out) = connect_for(&**agent, src, dst, &sandbox_id).await else {
        return reset(conn);
    };
    debug!(sandbox_id, host = name, rule = rule_host, %dst, "egress: intercepting");
    // The response must not wait for the guest's ACK of the session
    // tickets (Nagle + delayed ACK: 40 ms on every new TLS connection).
    let _ = conn.set_nodelay(true);
    let judge: Arc<dyn Judge> = Arc::new(RuleJudge {
        agent: agent.clone(),
        src,
        sandbox_id: sandbox_id.clone(),
    });
    let served = async {
        if tls {
            gateway.serve_tls(conn, buf, &name, out, judge).await
        } else {
            gateway.serve_http(conn, buf, &name, out, judge).await
        }
    };
    let cut = async {
        loop {
            if changed.changed().await.is_err() {
                match agent.proxy_decide(src, Some(&name), tls) {
                    ProxyDecision::Intercept {
                        sandbox_id: id,
                        changed: next,
                        ..
                    } if id == sandbox_id => changed = next,
                    _ => return,
                }
            }
        }
    };
    tokio::select! {
        r = served => if let Err(e) = r {
            debug!(sandbox_id, host = name, error = e, "egress: intercepted connection ended");
        },
        () = cut => info!(
            sandbox_id,
            host = name,
            "egress: intercepted connection closed: the sandbox's rules no longer name the \
             host, or it is gone"
        ),
    }
}

/// The core's rules, asked per request, and the audit record of each.
struct RuleJudge<A> {
    agent: Arc<A>,
    src: Ipv4Addr,
    sandbox_id: String,
}

impl<A: EgressPolicy> Judge for RuleJudge<A> {
    fn judge(&self, host: &str, method: &str, path: &str) -> Judgement {
        let Some(rule) = self.agent.egress_rule(self.src, &self.sandbox_id, host) else {
            return Judgement::Gone;
        };
        if let Err(why) = rule.allows(method, path) {
            return Judgement::Forbid {
                rule_host: rule.host,
                why,
            };
        }
        let set_headers = rule
            .set_headers
            .iter()
            .filter_map(|(k, v)| {
                let name = http::HeaderName::from_bytes(k.as_bytes()).ok()?;
                let mut value = http::HeaderValue::from_str(v.expose()).ok()?;
                value.set_sensitive(true);
                Some((name, value))
            })
            .collect();
        Judgement::Pass {
            set_headers,
            rule_host: rule.host,
        }
    }

    fn owner(&self) -> &str {
        &self.sandbox_id
    }

    fn audit(&self, r: AuditRecord) {
        self.agent
            .egress_request(self.src, &self.sandbox_id, r.verdict == "forwarded");
        info!(
            sandbox_id = self.sandbox_id.as_str(),
            method = r.method,
            host = r.host,
            path = r.path,
            status = r.status,
            bytes_up = r.bytes_up,
            bytes_down = r.bytes_down,
            rule = r.rule_host,
            verdict = r.verdict,
            duration_ms = r.duration.as_millis() as u64,
            "egress: {} {} {}{} {}",
            self.sandbox_id,
            r.method,
            r.host,
            r.path,
            r.status
        );
    }
}

/// Strict mode: resolves the name itself and dials it.
#[allow(clippy::too_many_arguments)]
async fn dial_name(
    agent: &impl EgressPolicy,
    upstream: Option<SocketAddrV4>,
    conn: TcpStream,
    buf: Vec<u8>,
    src: Ipv4Addr,
    dial_port: u16,
    sandbox_id: String,
    name: String,
    cidrs: Option<Arc<dyn crate::policy::AddrRules>>,
    changed: tokio::sync::watch::Receiver<()>,
) {
    let Some(dst) = resolve_for(agent, upstream, src, &sandbox_id, &name, cidrs.as_deref()).await
    else {
        return reset(conn);
    };
    let Some(out) = connect_for(agent, src, SocketAddr::from((dst, dial_port)), &sandbox_id).await
    else {
        return reset(conn);
    };
    // Until either side closes, or the sandbox's rules change so that this
    // name (or address) is no longer allowed, or the sandbox is released.
    let still = || agent.proxy_still(src, &sandbox_id, &name, dst);
    if send_and_splice(conn, out, &buf, changed, still).await {
        info!(
            sandbox_id,
            name, "proxy: connection reset: idle, or the sandbox's rules changed or it is gone"
        );
    }
}

/// The first address of `name` the sandbox may be dialled to: the same
/// addresses a DNS answer would teach the datapath (never the node's, the
/// pool, link-local and the like; private ones only under an allow CIDR;
/// not under a deny CIDR), and within `cidrs` when given.
async fn resolve_for(
    agent: &impl EgressPolicy,
    upstream: Option<SocketAddrV4>,
    src: Ipv4Addr,
    sandbox_id: &str,
    name: &str,
    cidrs: Option<&dyn crate::policy::AddrRules>,
) -> Option<Ipv4Addr> {
    let addrs = match lookup(upstream?, name).await {
        Ok(a) => a,
        Err(e) => {
            info!(sandbox_id, name, error = %e, "proxy: cannot resolve the name; reset");
            return None;
        }
    };
    let dst = addrs.into_iter().find(|a| {
        agent.name_target_refused(src, *a).is_none() && cidrs.is_none_or(|c| c.allows(*a))
    });
    if dst.is_none() {
        info!(
            sandbox_id,
            name, "proxy: the name has no public address the sandbox may reach; reset"
        );
    }
    dst
}

/// Copies both ways until both sides have closed (a close is passed on as
/// a shutdown of the other side's writing) or one fails; true when it
/// stopped because nothing moved for `idle`.
async fn splice(a: &mut TcpStream, b: &mut TcpStream, idle: Duration) -> bool {
    let (mut ar, mut aw) = a.split();
    let (mut br, mut bw) = b.split();
    let (mut from_a, mut from_b) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    let (mut a_open, mut b_open) = (true, true);
    while a_open || b_open {
        let step = tokio::time::timeout(idle, async {
            tokio::select! {
                r = ar.read(&mut from_a), if a_open => match r {
                    Ok(0) => {
                        a_open = false;
                        bw.shutdown().await
                    }
                    Ok(n) => bw.write_all(&from_a[..n]).await,
                    Err(e) => Err(e),
                },
                r = br.read(&mut from_b), if b_open => match r {
                    Ok(0) => {
                        b_open = false;
                        aw.shutdown().await
                    }
                    Ok(n) => aw.write_all(&from_b[..n]).await,
                    Err(e) => Err(e),
                },
            }
        })
        .await;
        match step {
            Err(_) => return true,
            Ok(Err(_)) => return false,
            Ok(Ok(())) => {}
        }
    }
    false
}

/// The A records of `name`, asked of the upstream.
/// SO_PRIORITY (a shaper class: CAP_NET_ADMIN, which the agent has);
/// best effort: unset, the connection is only unshaped.
fn set_priority(s: &TcpStream, class: u32) {
    use std::os::fd::AsRawFd;
    let v = class as libc::c_int;
    // SAFETY: setsockopt reads a live c_int of the given size; the fd is
    // the stream's own, open while `s` lives.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PRIORITY,
            (&raw const v).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        debug!(error = %std::io::Error::last_os_error(), "proxy: SO_PRIORITY not set");
    }
}

async fn lookup(upstream: SocketAddrV4, name: &str) -> std::io::Result<Vec<Ipv4Addr>> {
    let id = rand_id();
    let q = encode_query(id, name, TYPE_A);
    let resp = forward(upstream, &q, id).await?;
    let addrs: Vec<Ipv4Addr> = answer_addrs(&resp, name)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(a, _)| match a {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        })
        .collect();
    if addrs.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no A record",
        ));
    }
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello as a client sends it (one record), with `sni`.
    pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        let mut exts = vec![];
        exts.extend_from_slice(&[0, 43, 0, 3, 2, 3, 4]); // supported_versions
        if let Some(name) = sni {
            let n = name.len() as u16;
            exts.extend_from_slice(&[0, 0]);
            exts.extend_from_slice(&(n + 5).to_be_bytes());
            exts.extend_from_slice(&(n + 3).to_be_bytes());
            exts.push(0);
            exts.extend_from_slice(&n.to_be_bytes());
            exts.extend_from_slice(name.as_bytes());
        }
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn the_server_name_of_a_client_hello() {
        let h = client_hello(Some("WWW.Allowed.Test."));
        assert_eq!(
            tls_server_name(&h),
            Hello::Done(Some("www.allowed.test".into()))
        );
        // Every prefix asks for more.
        for n in 0..h.len() {
            // ... and never more than is still to come (a lower bound).
            match tls_server_name(&h[..n]) {
                Hello::More(k) => assert!(k >= 1 && k <= h.len() - n, "{n}: {k}"),
                other => panic!("{n}: {other:?}"),
            }
        }
        assert_eq!(tls_server_name(&client_hello(None)), Hello::Done(None));
        assert_eq!(
            tls_server_name(&client_hello(Some("198.51.100.2"))),
            Hello::Done(None)
        );
        assert_eq!(tls_server_name(b"GET / HTTP/1.1\r\n"), Hello::Done(None));
    }

    #[test]
    fn a_client_hello_split_over_records() {
        let h = client_hello(Some("a.allowed.test"));
        let hs = &h[5..];
        let mut two = vec![];
        for part in [&hs[..10], &hs[10..]] {
            two.extend_from_slice(&[22, 3, 1]);
            two.extend_from_slice(&(part.len() as u16).to_be_bytes());
            two.extend_from_slice(part);
        }
        assert_eq!(
            tls_server_name(&two),
            Hello::Done(Some("a.allowed.test".into()))
        );
        for n in 0..two.len() {
            match tls_server_name(&two[..n]) {
                Hello::More(k) => assert!(k >= 1 && k <= two.len() - n, "{n}: {k}"),
                other => panic!("{n}: {other:?}"),
            }
        }
        // Early data right behind the hello; and a hello cut by it.
        let mut early = h.clone();
        early.extend_from_slice(&[23, 3, 3, 0, 2, 9, 9]);
        assert_eq!(
            tls_server_name(&early),
            Hello::Done(Some("a.allowed.test".into()))
        );
        let mut cut = two[..15].to_vec(); // the first record only
        cut.extend_from_slice(&[23, 3, 3, 0, 2, 9, 9]);
        assert_eq!(tls_server_name(&cut), Hello::Done(None));
    }

    /// Two connected sockets over loopback.
    async fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    #[tokio::test]
    async fn splice_passes_data_and_closes_and_gives_up_when_idle() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        // guest <-> (a  proxy  b) <-> server
        let (mut guest, mut a) = pair(&l).await;
        let (mut b, mut server) = pair(&l).await;
        let relay =
            tokio::spawn(async move { splice(&mut a, &mut b, Duration::from_millis(300)).await });
        guest.write_all(b"hello").await.unwrap();
        guest.shutdown().await.unwrap();
        let mut got = vec![];
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello", "data, then the guest's close");
        server.write_all(b"world").await.unwrap();
        drop(server);
        let mut back = vec![];
        guest.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"world");
        assert!(!relay.await.unwrap(), "both closed: not idle");

        let (_guest, mut a) = pair(&l).await;
        let (mut b, _server) = pair(&l).await;
        let t = std::time::Instant::now();
        assert!(
            splice(&mut a, &mut b, Duration::from_millis(300)).await,
            "idle"
        );
        assert!(t.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn the_host_of_a_request() {
        let r = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nhost:  Www.Allowed.Test:80 \r\n\r\n";
        assert_eq!(http_host(r), Hello::Done(Some("www.allowed.test".into())));
        assert_eq!(http_host(&r[..20]), Hello::More(1));
        // The target's host is what a server takes: it must be Host's.
        let abs = b"GET http://www.allowed.test:80/x HTTP/1.1\r\nHost: www.allowed.test\r\n\r\n";
        assert_eq!(http_host(abs), Hello::Done(Some("www.allowed.test".into())));
        let other = b"GET http://evil.test/ HTTP/1.1\r\nHost: www.allowed.test\r\n\r\n";
        assert_eq!(http_host(other), Hello::Done(None));
        let connect = b"CONNECT www.allowed.test:443 HTTP/1.1\r\nHost: www.allowed.test\r\n\r\n";
        assert_eq!(http_host(connect), Hello::Done(None));
        assert_eq!(http_host(b"GET / HTTP/1.0\r\n\r\n"), Hello::Done(None));
        let two = b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n";
        assert_eq!(http_host(two), Hello::Done(None));
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n"),
            Hello::Done(None)
        );
        assert_eq!(http_host(&vec![b'a'; MAX_HELLO]), Hello::Done(None));
    }
}
