//! The metrics socket (`report_socket`, by default
//! `/run/systemd/report/org.cube.NetworkAgent`): systemd's
//! `io.systemd.Metrics` (what `systemd-report` collects, v260+) and
//! `org.cube.NetworkAgent.Metrics.OpenMetrics` (what `cubenetctl metrics`
//! prints), both renderings of [`crate::metrics`]. Reads like GetNetwork:
//! root, or the polkit action `org.cube.NetworkAgent.read` (the values
//! name every sandbox). Also writes `metrics_textfile` for node_exporter.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::{Operation, Peer, SERVICE_IDL, SERVICE_INTERFACE, authorize, note_refusal};
use crate::agent::Agent;
use crate::metrics::TextOut;

pub const METRICS_INTERFACE: &str = "io.systemd.Metrics";
pub const METRICS_IDL: &str = include_str!("../../varlink/io.systemd.Metrics.varlink");
pub const OPENMETRICS_INTERFACE: &str = "org.cube.NetworkAgent.Metrics";
pub const OPENMETRICS_IDL: &str =
    include_str!("../../varlink/org.cube.NetworkAgent.Metrics.varlink");

/// Requests are a few hundred bytes; anything larger closes the connection.
const MAX_REQUEST: usize = 64 << 10;
/// Connections served at once from users other than root (a scraper or
/// two, an operator's CLI), and from any one of them. Root is never
/// refused: no local user can hold the slots and starve systemd-report.
const MAX_CONNECTIONS: usize = 64;
const MAX_PER_UID: usize = 4;

/// Open connections of non-root peers, by uid.
#[derive(Default)]
struct Slots {
    per_uid: std::sync::Mutex<std::collections::HashMap<u32, usize>>,
}

/// One connection's place in [`Slots`]; given back on drop.
struct Slot {
    slots: Arc<Slots>,
    uid: u32,
}

impl Slots {
    fn take(self: &Arc<Self>, uid: u32) -> Option<Slot> {
        let mut m = self.per_uid.lock().unwrap_or_else(|p| p.into_inner());
        let total: usize = m.values().sum();
        let mine = m.entry(uid).or_default();
        if total >= MAX_CONNECTIONS || *mine >= MAX_PER_UID {
            return None;
        }
        *mine += 1;
        Some(Slot {
            slots: self.clone(),
            uid,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.slots.per_uid.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.uid);
            }
        }
    }
}

fn error(name: &str, parameters: Value) -> Value {
    json!({ "error": name, "parameters": parameters })
}

/// How the families become replies.
enum Render {
    Describe,
    List,
}

/// What a call answers: replies as values, or metric families rendered
/// straight onto the socket.
enum Reply {
    Values(Vec<Value>),
    List(Vec<crate::metrics::Family>),
    OpenMetrics(Vec<crate::metrics::Family>),
}

/// A scrape's replies go out in pieces of about this size: the buffer is
/// reused, so a scrape at 10,000 sandboxes never builds (and page-faults
/// in) its whole multi-megabyte answer.
const CHUNK: usize = 256 << 10;
/// Samples rendered between two looks at the buffer (~100 bytes each).
const SAMPLES_PER_CHUNK: usize = 512;

/// Sends the replies to one call (NUL-terminated messages, every one of a
/// stream but the last with `continues`) into `w` (`None`: a oneway call,
/// nothing sent); returns the bytes sent.
async fn call<W: AsyncWriteExt + Unpin>(
    agent: &Agent,
    peer: &Peer,
    method: &str,
    p: &Map<String, Value>,
    more: bool,
    mut w: Option<&mut W>,
) -> io::Result<usize> {
    let mut out = Vec::with_capacity(CHUNK + (64 << 10));
    let mut sent = 0;
    let mut flush = async |out: &mut Vec<u8>, k: usize| -> io::Result<()> {
        if let Some(w) = w.as_mut() {
            w.write_all(&out[..k]).await?;
        }
        sent += k;
        out.drain(..k);
        Ok(())
    };
    match call_values(agent, peer, method, p, more).await {
        Reply::Values(values) => {
            for v in values {
                serde_json::to_writer(&mut out, &v).expect("a reply serialises");
                out.push(0);
            }
        }
        Reply::List(families) => {
            let mut lw = crate::metrics::ListWriter::default();
            for f in &families {
                for part in f.samples.chunks(SAMPLES_PER_CHUNK) {
                    lw.samples(f, part, &mut out);
                    if out.len() >= CHUNK {
                        let k = lw.settled();
                        flush(&mut out, k).await?;
                        lw.drained(k);
                    }
                }
            }
        }
        Reply::OpenMetrics(families) => {
            out.extend_from_slice(b"{\"parameters\":{\"text\":\"");
            for f in &families {
                crate::metrics::openmetrics_header(f, &mut TextOut::json(&mut out));
                for part in f.samples.chunks(SAMPLES_PER_CHUNK) {
                    crate::metrics::openmetrics_samples(f, part, &mut TextOut::json(&mut out));
                    if out.len() >= CHUNK {
                        let k = out.len();
                        flush(&mut out, k).await?;
                    }
                }
            }
            crate::metrics::openmetrics_end(&mut TextOut::json(&mut out));
            out.extend_from_slice(b"\"}}\0");
        }
    }
    let k = out.len();
    flush(&mut out, k).await?;
    Ok(sent)
}

/// The replies to one call.
async fn call_values(
    agent: &Agent,
    peer: &Peer,
    method: &str,
    p: &Map<String, Value>,
    more: bool,
) -> Reply {
    let stream = match method {
        "org.varlink.service.GetInfo" => {
            return Reply::Values(vec![json!({"parameters": {
                "vendor": "cube-network-agent",
                "product": "cube-network-agent",
                "version": env!("CARGO_PKG_VERSION"),
                "url": "man:cube-network-agent(8)",
                "interfaces": [SERVICE_INTERFACE, METRICS_INTERFACE, OPENMETRICS_INTERFACE],
            }})]);
        }
        "org.varlink.service.GetInterfaceDescription" => {
            let description = match p.get("interface").and_then(Value::as_str) {
                Some(SERVICE_INTERFACE) => SERVICE_IDL,
                Some(METRICS_INTERFACE) => METRICS_IDL,
                Some(OPENMETRICS_INTERFACE) => OPENMETRICS_IDL,
                Some(other) => {
                    return Reply::Values(vec![error(
                        "org.varlink.service.InterfaceNotFound",
                        json!({ "interface": other }),
                    )]);
                }
                None => {
                    return Reply::Values(vec![error(
                        "org.varlink.service.InvalidParameter",
                        json!({ "parameter": "interface" }),
                    )]);
                }
            };
            return Reply::Values(vec![json!({"parameters": { "description": description }})]);
        }
        "io.systemd.Metrics.List" => Some(Render::List),
        "io.systemd.Metrics.Describe" => Some(Render::Describe),
        "org.cube.NetworkAgent.Metrics.OpenMetrics" => None,
        other => {
            return Reply::Values(vec![error(
                "org.varlink.service.MethodNotFound",
                json!({ "method": other }),
            )]);
        }
    };
    if let Err(denied) = authorize(peer, Operation::Read).await {
        let name = if stream.is_some() {
            "org.varlink.service.PermissionDenied"
        } else {
            "org.cube.NetworkAgent.Metrics.AccessDenied"
        };
        note_refusal("report", peer, method, "", name, &denied.0);
        let params = if stream.is_some() {
            json!({})
        } else {
            json!({ "message": denied.0 })
        };
        return Reply::Values(vec![error(name, params)]);
    }
    if stream.is_some() && !more {
        return Reply::Values(vec![error("org.varlink.service.ExpectedMore", json!({}))]);
    }
    let families = match agent.metrics().await {
        Ok(f) => f,
        Err(e) => {
            let m = e.to_string();
            return Reply::Values(vec![match stream {
                Some(_) => error("io.systemd.Metrics.NoSuchMetric", json!({})),
                None => error(
                    "org.cube.NetworkAgent.Metrics.Failed",
                    json!({ "message": m }),
                ),
            }]);
        }
    };
    match stream {
        Some(Render::List) => Reply::List(families),
        Some(Render::Describe) => {
            let items = crate::metrics::describe(&families);
            let n = items.len();
            Reply::Values(
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| {
                        if i + 1 < n {
                            json!({ "parameters": v, "continues": true })
                        } else {
                            json!({ "parameters": v })
                        }
                    })
                    .collect(),
            )
        }
        // Written onto the socket a family at a time (`call`).
        None => Reply::OpenMetrics(families),
    }
}

async fn connection(agent: Arc<Agent>, slots: Arc<Slots>, mut stream: UnixStream) {
    let peer = match Peer::of(&stream) {
        Ok(p) => p,
        Err(e) => {
            debug!(error = %e, "report socket: no peer credentials");
            return;
        }
    };
    let _slot = if peer.uid == 0 {
        None
    } else {
        match slots.take(peer.uid) {
            Some(s) => Some(s),
            None => {
                note_refusal(
                    "report",
                    &peer,
                    "(connection)",
                    "",
                    "LimitsExceeded",
                    &format!(
                        "too many connections to the metrics socket (at most {MAX_PER_UID} per \
                         uid, {MAX_CONNECTIONS} in all but root's); closed"
                    ),
                );
                return;
            }
        }
    };
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    loop {
        while let Some(end) = buf.iter().position(|&b| b == 0) {
            let msg: Vec<u8> = buf.drain(..=end).take(end).collect();
            let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(&msg) else {
                return;
            };
            let Some(Value::String(method)) = m.remove("method") else {
                return;
            };
            let more = m.get("more").and_then(Value::as_bool).unwrap_or(false);
            let oneway = m.get("oneway").and_then(Value::as_bool).unwrap_or(false);
            let params = match m.remove("parameters") {
                Some(Value::Object(p)) => p,
                _ => Map::new(),
            };
            let to = if oneway { None } else { Some(&mut stream) };
            match call(&agent, &peer, &method, &params, more, to).await {
                Ok(bytes) => debug!(method, uid = peer.uid, bytes, "report socket call"),
                Err(_) => return,
            }
        }
        if buf.len() > MAX_REQUEST {
            return;
        }
        match stream.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Binds `path` ([`super::bind_fresh`]), creating its directory 0755 if
/// missing.
fn bind(path: &Path) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)))
            .map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    super::bind_fresh(path).map_err(|e| crate::error_chain(&e))
}

/// Writes the OpenMetrics text to `path` atomically (a temporary file in
/// the same directory, renamed over it), mode 0640: the values name every
/// sandbox. node_exporter reads it when the directory's group is its own
/// (a setgid directory gives the file that group).
fn write_textfile(path: &Path, text: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    // A fresh file of ours, never one found there (a stale one of another
    // mode, or a link someone put in the directory): removed, then
    // created exclusively, not following links.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o640)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_data()?;
    std::fs::rename(&tmp, path)
}

/// Serves the report socket and the textfile in the background (either may
/// be off: an empty `report_socket` / `metrics_textfile`). A socket that
/// cannot be bound (systemd before v260 has no /run/systemd/report, and
/// the unit may not write there) is a warning, not a failure.
pub fn serve(agent: Arc<Agent>) {
    let cfg = agent.config();
    let socket = cfg.report_socket.clone();
    let textfile = cfg.metrics_textfile.clone();
    let every = Duration::from_secs(u64::from(cfg.metrics_interval.max(1)));
    if !socket.as_os_str().is_empty() {
        match bind(&socket) {
            Ok(l) => {
                info!(path = %socket.display(), "metrics: io.systemd.Metrics on the report socket");
                let agent = agent.clone();
                tokio::spawn(async move {
                    let slots = Arc::new(Slots::default());
                    loop {
                        match l.accept().await {
                            Ok((stream, _)) => {
                                tokio::spawn(connection(agent.clone(), slots.clone(), stream));
                            }
                            Err(e) => {
                                warn!(error = %e, "report socket: accept failed");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                });
            }
            Err(e) => warn!(
                path = %socket.display(),
                error = %e,
                "metrics: cannot bind the report socket; io.systemd.Metrics is unavailable"
            ),
        }
    }
    if !textfile.as_os_str().is_empty() {
        info!(path = %textfile.display(), every_s = every.as_secs(), "metrics: writing the OpenMetrics textfile");
        tokio::spawn(async move {
            let mut warned = false;
            loop {
                let r = match agent.metrics().await {
                    Ok(f) => {
                        let text = crate::metrics::openmetrics(&f);
                        let path = textfile.clone();
                        tokio::task::spawn_blocking(move || write_textfile(&path, &text))
                            .await
                            .unwrap_or_else(|e| Err(io::Error::other(e.to_string())))
                    }
                    Err(e) => Err(io::Error::other(e.to_string())),
                };
                match r {
                    Ok(()) => warned = false,
                    Err(e) if !warned => {
                        warned = true;
                        warn!(path = %textfile.display(), error = %e, "metrics: writing the textfile failed");
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(every).await;
            }
        });
    }
}
