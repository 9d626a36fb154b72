//! `cubenetctl flows`: the agent's flow log over varlink WatchFlows (like
//! `hubble observe`): the kept records of the last hour, or with --follow
//! every new one until interrupted; one line per record.

use serde_json::{Value as Json, json};

use crate::args::Global;
use crate::failure::{EXIT_AGENT, EXIT_OK, Failure, Res};
use crate::output::{Output, cell, count, emit, json_text, jstr};
use crate::varlink::Varlink;

const METHOD: &str = "org.cube.NetworkAgent.WatchFlows";

/// The header line (text output, unless --no-legend).
pub const HEADER: &str = "TIME SANDBOX EVENT PROTO GUEST REMOTE NODE VERDICT DETAIL";

/// The most the agent keeps, and so the most `--since` may ask for.
pub const MAX_SINCE: u64 = 3600;

/// The options of `flows` (accepted only after the command name).
pub const FLAGS: &[&str] = &["--denied", "--follow", "--since"];

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FlowsOpts {
    /// One sandbox's records (else every sandbox's).
    pub sandbox_id: Option<String>,
    /// Refused records only.
    pub denied: bool,
    /// Keep following new records.
    pub follow: bool,
    /// `--since`, seconds (None: an hour, or with --follow none).
    pub since: Option<u64>,
}

impl FlowsOpts {
    /// WatchFlows' parameters.
    pub fn parameters(&self) -> Json {
        let since = self
            .since
            .unwrap_or(if self.follow { 0 } else { MAX_SINCE });
        let mut p = json!({
            "denied": self.denied,
            "since_seconds": since,
            "follow": self.follow,
        });
        if let Some(id) = &self.sandbox_id {
            p["sandbox_id"] = Json::String(id.clone());
        }
        p
    }
}

/// `--since DURATION`: `30s`, `10m`, `1h` or plain seconds, at most an
/// hour.
pub fn parse_since(s: &str) -> Result<u64, String> {
    let bad = || format!("--since '{s}': expected seconds or a duration such as 30s, 10m or 1h");
    let (digits, unit) = match s.strip_suffix(['s', 'm', 'h']) {
        Some(d) => (d, &s[d.len()..]),
        None => (s, "s"),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let secs = match unit {
        "h" => n.checked_mul(3600),
        "m" => n.checked_mul(60),
        _ => Some(n),
    };
    match secs {
        Some(secs) if secs <= MAX_SINCE => Ok(secs),
        _ => Err(format!(
            "--since {s}: more than 1h (the agent keeps an hour of records at most)"
        )),
    }
}

/// `HH:MM:SS.mmm` (UTC) of a time in nanoseconds since the epoch.
fn clock(unix_ns: u64) -> String {
    let ms = unix_ns / 1_000_000;
    let s = ms / 1000 % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        ms % 1000
    )
}

/// `ip:port`, `[v6]:port`; `-` if absent.
fn endpoint(e: Option<&Json>, ascii: bool) -> String {
    let Some(e) = e.filter(|e| e.is_object()) else {
        return "-".into();
    };
    let ip = e.get("ip").map(jstr).unwrap_or_default();
    let port = e.get("port").map(jstr).unwrap_or_default();
    if ip.contains(':') {
        cell(&format!("[{ip}]:{port}"), ascii)
    } else {
        cell(&format!("{ip}:{port}"), ascii)
    }
}

/// One record as a text line: the columns of [`HEADER`], then DETAIL:
/// why it was refused, the DNS name, an end's totals (bytes/packets each
/// way and the duration).
pub fn line(f: &Json, out: &Output) -> String {
    let s = |k: &str| cell(&f.get(k).map(jstr).unwrap_or_default(), out.ascii);
    let time = f
        .get("time_unix_ns")
        .and_then(Json::as_u64)
        .map_or_else(|| "-".to_owned(), clock);
    let mut cells = vec![
        time,
        s("sandbox_id"),
        s("event"),
        s("protocol"),
        endpoint(f.get("guest"), out.ascii),
        endpoint(f.get("remote"), out.ascii),
        endpoint(f.get("node"), out.ascii),
        s("verdict"),
    ];
    for k in ["reason", "dns_name"] {
        if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
            cells.push(cell(&jstr(v), out.ascii));
        }
    }
    if let Some(t) = f.get("totals").filter(|t| t.is_object()) {
        let n = |k: &str| t.get(k).and_then(Json::as_u64).unwrap_or(0);
        let (up, down) = if out.ascii {
            ("out=", "in=")
        } else {
            ("\u{2191}", "\u{2193}")
        };
        cells.push(format!("{up}{}/{}", n("bytes_out"), n("packets_out")));
        cells.push(format!("{down}{}/{}", n("bytes_in"), n("packets_in")));
        let ms = n("duration_ms");
        cells.push(format!("{}.{}s", ms / 1000, ms % 1000 / 100));
    }
    cells.join(" ")
}

pub fn run(g: &Global, o: &FlowsOpts) -> Res<u8> {
    let mut v = Varlink::connect(&g.varlink)?;
    v.call_with(METHOD, o.parameters(), true)?;
    let mut header = !g.out.json() && g.out.legend;
    loop {
        let Some(reply) = v.recv()? else {
            return Err(Failure::new(
                EXIT_AGENT,
                "the agent ended the stream (it is stopping or restarting)",
            ));
        };
        // Once the stream started (an error before it prints none).
        if std::mem::take(&mut header) {
            emit(&format!("{HEADER}\n"));
        }
        let p = &reply.parameters;
        if let Some(f) = p.get("flow").filter(|f| f.is_object()) {
            if g.out.json() {
                emit(&format!("{}\n", json_text(g.out.json, f)));
            } else {
                emit(&format!("{}\n", line(f, &g.out)));
            }
        }
        if let Some(n) = p.get("lost").and_then(Json::as_u64) {
            if g.out.json() {
                emit(&format!("{}\n", json_text(g.out.json, &json!({"lost": n}))));
            } else {
                eprintln!("# {} lost", count(n as usize, "record"));
            }
        }
        if !reply.continues {
            if o.follow {
                return Err(Failure::new(EXIT_AGENT, "the agent ended the stream"));
            }
            return Ok(EXIT_OK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::JsonMode;

    const ASCII: Output = Output {
        json: JsonMode::Off,
        legend: true,
        quiet: false,
        ascii: true,
    };
    const UTF8: Output = Output {
        ascii: false,
        ..ASCII
    };

    #[test]
    fn durations_parse_up_to_an_hour() {
        assert_eq!(parse_since("30s"), Ok(30));
        assert_eq!(parse_since("10m"), Ok(600));
        assert_eq!(parse_since("1h"), Ok(3600));
        assert_eq!(parse_since("45"), Ok(45));
        assert_eq!(parse_since("0"), Ok(0));
        assert_eq!(parse_since("3600s"), Ok(3600));
        assert_eq!(
            parse_since("2h"),
            Err("--since 2h: more than 1h (the agent keeps an hour of records at most)".into())
        );
        assert!(parse_since("61m").unwrap_err().contains("more than 1h"));
        assert!(
            parse_since("99999999999999999999h")
                .unwrap_err()
                .contains("--since")
        );
        for bad in ["", "s", "1d", "-1", "1.5m", "m5", "1 h"] {
            assert_eq!(
                parse_since(bad),
                Err(format!(
                    "--since '{bad}': expected seconds or a duration such as 30s, 10m or 1h"
                ))
            );
        }
    }

    #[test]
    fn parameters_default_to_the_last_hour_or_following() {
        let o = FlowsOpts::default();
        assert_eq!(
            o.parameters(),
            json!({"denied": false, "since_seconds": 3600, "follow": false})
        );
        let o = FlowsOpts {
            sandbox_id: Some("a".into()),
            denied: true,
            follow: true,
            since: None,
        };
        assert_eq!(
            o.parameters(),
            json!({"sandbox_id": "a", "denied": true, "since_seconds": 0, "follow": true})
        );
        let o = FlowsOpts {
            follow: true,
            since: Some(60),
            ..FlowsOpts::default()
        };
        assert_eq!(o.parameters()["since_seconds"], 60);
    }

    #[test]
    fn one_line_per_record() {
        let refused = json!({
            "time": "2025-03-01T12:00:00.123456Z",
            "time_unix_ns": 1_740_830_400_123_456_789_u64,
            "sandbox_id": "sbx-1", "event": "refused", "family": 4, "protocol": "tcp",
            "direction": "egress",
            "guest": {"ip": "169.254.68.6", "port": 41000},
            "remote": {"ip": "203.0.113.9", "port": 443},
            "verdict": "dropped", "reason": "policy", "dns_name": "blocked.example.com",
        });
        assert_eq!(
            line(&refused, &ASCII),
            "12:00:00.123 sbx-1 refused tcp 169.254.68.6:41000 203.0.113.9:443 - dropped policy blocked.example.com"
        );
        let end = json!({
            "time": "2025-03-01T23:59:59.999000Z",
            "time_unix_ns": 1_740_873_599_999_000_000_u64,
            "sandbox_id": "b", "event": "end", "family": 6, "protocol": "udp",
            "direction": "egress",
            "guest": {"ip": "fd00::2", "port": 5353},
            "remote": {"ip": "2001:db8::1", "port": 53},
            "node": {"ip": "2001:db8:1::10", "port": 20053},
            "verdict": "forwarded",
            "totals": {"bytes_out": 1200, "packets_out": 3, "bytes_in": 400,
                       "packets_in": 2, "duration_ms": 1530},
        });
        assert_eq!(
            line(&end, &ASCII),
            "23:59:59.999 b end udp [fd00::2]:5353 [2001:db8::1]:53 [2001:db8:1::10]:20053 forwarded out=1200/3 in=400/2 1.5s"
        );
        assert_eq!(
            line(&end, &UTF8),
            "23:59:59.999 b end udp [fd00::2]:5353 [2001:db8::1]:53 [2001:db8:1::10]:20053 forwarded \u{2191}1200/3 \u{2193}400/2 1.5s"
        );
        // A start: no detail; a name with a space stays one cell.
        let start = json!({
            "time_unix_ns": 5_000_000_u64, "sandbox_id": "c", "event": "start",
            "protocol": "icmp", "guest": {"ip": "10.0.0.2", "port": 7},
            "remote": {"ip": "10.0.0.1", "port": 0},
            "node": {"ip": "192.0.2.1", "port": 7}, "verdict": "forwarded",
            "dns_name": "a b",
        });
        assert_eq!(
            line(&start, &ASCII),
            "00:00:00.005 c start icmp 10.0.0.2:7 10.0.0.1:0 192.0.2.1:7 forwarded a\\x20b"
        );
    }
}
