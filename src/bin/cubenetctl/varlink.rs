//! A minimal blocking varlink client: NUL-terminated JSON messages over the
//! agent's Unix socket, for the streams: `watch` and `flows` (the agent's
//! D-Bus signals reach root only; its varlink streams reach every reader
//! polkit allows), and the metrics socket (`metrics`, `top`).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde_json::{Value as Json, json};

use crate::failure::{EXIT_AGENT, EXIT_NOT_FOUND, EXIT_UNREACHABLE, Failure, Res};

const AGENT_INTERFACE: &str = "org.cube.NetworkAgent.";
/// No single reply is larger (the first WatchNetworks reply lists every
/// network: ~1 KiB each).
const MAX_MESSAGE: usize = 256 << 20;

pub struct Varlink {
    sock: UnixStream,
    buf: Vec<u8>,
    /// Where the search for the next NUL resumes.
    scanned: usize,
}

/// One reply's parameters and whether more replies follow.
pub struct Reply {
    pub parameters: Json,
    pub continues: bool,
}

/// An error reply → exit status and `NAME: message`.
fn error_failure(name: &str, params: &Json) -> Failure {
    let short = name.rsplit('.').next().unwrap_or(name);
    let code = match (name.starts_with(AGENT_INTERFACE), short) {
        (true, "NotFound") => EXIT_NOT_FOUND,
        (true, "AccessDenied" | "LimitsExceeded") => EXIT_UNREACHABLE,
        _ if name == "org.varlink.service.PermissionDenied" => EXIT_UNREACHABLE,
        _ => EXIT_AGENT,
    };
    // A refusal (the agent's or the varlink service's, which carries no
    // message): say so and what grants access.
    if short == "AccessDenied" || name == "org.varlink.service.PermissionDenied" {
        let why = params
            .get("message")
            .and_then(Json::as_str)
            .unwrap_or("the agent refused this user");
        return Failure::new(
            code,
            format!("AccessDenied: {why}{}", crate::failure::access_hint()),
        );
    }
    let msg = match (short, params.get("message").and_then(Json::as_str)) {
        ("EventsLost", _) => format!(
            "this watcher fell behind and missed {} events; run it again",
            params
                .get("missed")
                .map(Json::to_string)
                .unwrap_or_default()
        ),
        (_, Some(m)) => m.to_owned(),
        (_, None) if params.as_object().is_some_and(|o| !o.is_empty()) => params.to_string(),
        _ => String::new(),
    };
    let name = if name.starts_with(AGENT_INTERFACE) {
        short
    } else {
        name
    };
    Failure::new(
        code,
        format!("{name}: {msg}").trim_end_matches(": ").to_owned(),
    )
}

/// `cubenetctl metrics`: the OpenMetrics text from the metrics socket.
pub fn openmetrics(path: &Path) -> Res<String> {
    let mut v = Varlink::connect_report(path)?;
    v.call("org.cube.NetworkAgent.Metrics.OpenMetrics", false)?;
    let reply = v
        .recv()?
        .ok_or_else(|| Failure::new(EXIT_UNREACHABLE, "the agent closed the metrics connection"))?;
    reply
        .parameters
        .get("text")
        .and_then(Json::as_str)
        .map(str::to_owned)
        .ok_or_else(|| Failure::new(EXIT_AGENT, "the agent's reply has no text"))
}

impl Varlink {
    /// The agent's metrics socket (`metrics`, `top`).
    pub fn connect_report(path: &Path) -> Res<Varlink> {
        Self::connect_to(path, "metrics", "its report_socket; $CUBENETCTL_REPORT")
    }

    pub fn connect(path: &Path) -> Res<Varlink> {
        Self::connect_to(path, "varlink", "see --varlink")
    }

    /// Connects to the agent's `what` socket; `hint` says where its path
    /// comes from.
    fn connect_to(path: &Path, what: &str, hint: &str) -> Res<Varlink> {
        let sock = UnixStream::connect(path).map_err(|e| {
            Failure::new(
                EXIT_UNREACHABLE,
                format!(
                    "cannot connect to the agent's {what} socket {}: {e} \
                     (is cube-network-agent running? {hint})",
                    path.display()
                ),
            )
        })?;
        Ok(Varlink {
            sock,
            buf: vec![],
            scanned: 0,
        })
    }

    fn lost(e: std::io::Error) -> Failure {
        Failure::new(
            EXIT_UNREACHABLE,
            format!("the agent's varlink connection failed: {e}"),
        )
    }

    /// Calls `method` (a full name), asking for a stream if `more`.
    pub fn call(&mut self, method: &str, more: bool) -> Res<()> {
        self.call_with(method, json!({}), more)
    }

    /// Calls `method` with `parameters` (an object).
    pub fn call_with(&mut self, method: &str, parameters: Json, more: bool) -> Res<()> {
        let mut msg = json!({"method": method, "parameters": parameters});
        if more {
            msg["more"] = Json::Bool(true);
        }
        let mut bytes = serde_json::to_vec(&msg).expect("JSON serializes");
        bytes.push(0);
        self.sock.write_all(&bytes).map_err(Self::lost)
    }

    /// The next reply; `Ok(None)` when the agent closed the connection, an
    /// error reply as a [`Failure`].
    pub fn recv(&mut self) -> Res<Option<Reply>> {
        loop {
            if let Some(pos) = self.buf[self.scanned..].iter().position(|&b| b == 0) {
                let end = self.scanned + pos;
                let msg: Vec<u8> = self.buf.drain(..=end).collect();
                self.scanned = 0;
                let v: Json = serde_json::from_slice(&msg[..end]).map_err(|e| {
                    Failure::new(EXIT_AGENT, format!("the agent sent malformed JSON: {e}"))
                })?;
                let params = v.get("parameters").cloned().unwrap_or(json!({}));
                if let Some(name) = v.get("error").and_then(Json::as_str) {
                    return Err(error_failure(name, &params));
                }
                return Ok(Some(Reply {
                    parameters: params,
                    continues: v.get("continues").and_then(Json::as_bool) == Some(true),
                }));
            }
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_MESSAGE {
                return Err(Failure::new(
                    EXIT_AGENT,
                    format!("a reply from the agent is larger than {MAX_MESSAGE} bytes"),
                ));
            }
            let mut chunk = [0u8; 64 * 1024];
            let n = match self.sock.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
                Err(e) => return Err(Self::lost(e)),
            };
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_exit_statuses() {
        let f = error_failure(
            "org.cube.NetworkAgent.AccessDenied",
            &json!({"message": "not allowed"}),
        );
        assert_eq!(f.code, EXIT_UNREACHABLE);
        assert!(
            f.msg
                .starts_with("AccessDenied: not allowed (root may do everything")
                && f.msg.contains("50-cube-network-agent.rules.example"),
            "{}",
            f.msg
        );
        // `top` as a user polkit refuses: the streaming metrics call's
        // bare varlink error is a refusal too (exit 4, with the hint).
        let f = error_failure("org.varlink.service.PermissionDenied", &json!({}));
        assert_eq!(f.code, EXIT_UNREACHABLE);
        assert!(
            f.msg
                .starts_with("AccessDenied: the agent refused this user (root may")
                && f.msg.contains("org.cube.NetworkAgent.read"),
            "{}",
            f.msg
        );
        let f = error_failure("org.cube.NetworkAgent.EventsLost", &json!({"missed": 7}));
        assert_eq!(f.code, EXIT_AGENT);
        assert!(
            f.msg.starts_with("EventsLost: ") && f.msg.contains("missed 7"),
            "{}",
            f.msg
        );
        let f = error_failure(
            "org.varlink.service.MethodNotFound",
            &json!({"method": "x"}),
        );
        assert_eq!(f.code, EXIT_AGENT);
        assert!(
            f.msg.starts_with("org.varlink.service.MethodNotFound: "),
            "{}",
            f.msg
        );
        let f = error_failure("org.varlink.service.ExpectedMore", &json!({}));
        assert_eq!(f.msg, "org.varlink.service.ExpectedMore");
    }

    #[test]
    fn replies_are_split_on_nul() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut v = Varlink {
            sock: a,
            buf: vec![],
            scanned: 0,
        };
        b.write_all(b"{\"parameters\":{\"x\":1},\"continues\":true}\0{\"parameters\":")
            .unwrap();
        b.write_all(b"{\"x\":2}}\0{\"error\":\"org.cube.NetworkAgent.Failed\",\"parameters\":{\"message\":\"m\"}}\0")
            .unwrap();
        drop(b);
        let r = v.recv().unwrap().unwrap();
        assert_eq!((r.parameters["x"].as_u64(), r.continues), (Some(1), true));
        let r = v.recv().unwrap().unwrap();
        assert_eq!((r.parameters["x"].as_u64(), r.continues), (Some(2), false));
        assert_eq!(v.recv().err().unwrap().msg, "Failed: m");
        assert!(v.recv().unwrap().is_none());
    }
}
