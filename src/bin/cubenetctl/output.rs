//! Everything printed on stdout: JSON, tables, `Key: value` blocks, and the
//! rules that make them script-friendly — table cells never contain
//! whitespace (so `--no-legend` rows split cleanly), and text is ASCII-only
//! when the locale's character set is not UTF-8.

use std::io::Write;

use serde_json::{Map, Value as Json};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonMode {
    Off,
    Short,
    Pretty,
}

#[derive(Debug, Clone, Copy)]
pub struct Output {
    pub json: JsonMode,
    /// Column headers and summary lines.
    pub legend: bool,
    /// No informational lines ("N networks.", "released ID", "healthy").
    pub quiet: bool,
    /// The locale is not UTF-8: escape anything outside ASCII, no arrows.
    pub ascii: bool,
}

impl Output {
    pub fn json(&self) -> bool {
        self.json != JsonMode::Off
    }

    /// Summary lines: not with `--no-legend` or `--quiet`.
    pub fn summaries(&self) -> bool {
        self.legend && !self.quiet
    }

    pub fn arrow(&self) -> &'static str {
        if self.ascii { "->" } else { "→" }
    }
}

/// Whether the locale's character set is UTF-8, from the variables in
/// POSIX's order of precedence (the first one set and non-empty decides);
/// none set means the C locale, which is ASCII.
pub fn locale_is_utf8(var: impl Fn(&str) -> Option<String>) -> bool {
    ["LC_ALL", "LC_CTYPE", "LANG"]
        .iter()
        .find_map(|k| var(k).filter(|v| !v.is_empty()))
        .is_some_and(|v| {
            let v = v.to_ascii_lowercase();
            v.contains("utf-8") || v.contains("utf8")
        })
}

/// Writes `s` to stdout. A closed pipe (`cubenetctl list | head -1`) ends
/// the program quietly, like SIGPIPE would a C tool.
pub fn emit(s: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(s.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("cubenetctl: writing to stdout: {e}");
        std::process::exit(1);
    }
}

pub fn json_text(mode: JsonMode, v: &Json) -> String {
    match mode {
        JsonMode::Pretty => serde_json::to_string_pretty(v),
        _ => serde_json::to_string(v),
    }
    .expect("JSON values serialize")
}

pub fn print_json(mode: JsonMode, v: &Json) {
    emit(&format!("{}\n", json_text(mode, v)));
}

/// `1 network.`, `2 networks.`, `0 networks.`
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

fn escape_char(c: char, out: &mut String) {
    let mut buf = [0u8; 4];
    for b in c.encode_utf8(&mut buf).bytes() {
        out.push_str(&format!("\\x{b:02x}"));
    }
}

/// Free text (a `status` value, an error message): control characters
/// escaped as `\xNN`, and with `ascii` everything outside ASCII too.
pub fn text(s: &str, ascii: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() || (ascii && !c.is_ascii()) {
            escape_char(c, &mut out);
        } else {
            out.push(c);
        }
    }
    out
}

/// A table cell: one whitespace-free token. Whitespace, control characters
/// and backslashes are escaped (`\x20`, `\\`), with `ascii` everything
/// outside ASCII too; an empty value is `-`.
pub fn cell(s: &str, ascii: bool) -> String {
    if s.is_empty() {
        return "-".into();
    }
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if c.is_whitespace() || c.is_control() || (ascii && !c.is_ascii()) {
            escape_char(c, &mut out);
        } else {
            out.push(c);
        }
    }
    out
}

/// A JSON value as plain text (strings unquoted, null empty).
pub fn jstr(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        Json::Null => String::new(),
        other => other.to_string(),
    }
}

fn field(o: &Json, k: &str) -> String {
    o.get(k).map(jstr).unwrap_or_default()
}

/// The wildcard host address is the common case: left out of port texts.
fn any_address(ip: &str) -> bool {
    ip.is_empty() || ip == "0.0.0.0" || ip == "::"
}

/// One port mapping as a token, in `ensure --port` syntax:
/// `tcp:80:20000`, `udp:53:25053:127.0.0.1`.
pub fn port_token(m: &Json) -> String {
    let ip = field(m, "host_ip");
    let mut s = format!(
        "{}:{}:{}",
        field(m, "protocol"),
        field(m, "container_port"),
        field(m, "host_port")
    );
    if !any_address(&ip) {
        s.push(':');
        s.push_str(&ip);
    }
    s
}

/// The PORTS cell: tokens joined by commas, `-` if none.
pub fn ports_cell(v: Option<&Json>, ascii: bool) -> String {
    let list: Vec<String> = v
        .and_then(Json::as_array)
        .map(|a| a.iter().map(port_token).collect())
        .unwrap_or_default();
    cell(&list.join(","), ascii)
}

/// One port mapping for people: `tcp 80 → 20000`, `udp 53 → 127.0.0.1:25053`.
fn port_line(m: &Json, out: &Output) -> String {
    let ip = field(m, "host_ip");
    let host = if any_address(&ip) {
        field(m, "host_port")
    } else {
        format!("{ip}:{}", field(m, "host_port"))
    };
    format!(
        "{} {} {} {host}",
        field(m, "protocol"),
        field(m, "container_port"),
        out.arrow()
    )
}

/// One egress rule for people: `api.example.com: headers
/// authorization=sha256:0123456789ab; methods GET, POST; paths /v1; plain
/// HTTP no`. A header's value is the agent's digest of it: the agent never
/// sends the value.
fn rule_line(r: &Json) -> String {
    let list = |k: &str| -> String {
        let items: Vec<String> = r
            .get(k)
            .and_then(Json::as_array)
            .map(|a| a.iter().map(jstr).collect())
            .unwrap_or_default();
        if items.is_empty() {
            "any".into()
        } else {
            items.join(", ")
        }
    };
    let headers: Vec<String> = r
        .get("set_headers")
        .and_then(Json::as_object)
        .map(|h| h.iter().map(|(k, v)| format!("{k}={}", jstr(v))).collect())
        .unwrap_or_default();
    let headers = if headers.is_empty() {
        "none".to_owned()
    } else {
        headers.join(", ")
    };
    let plain = r.get("plain_http").and_then(Json::as_bool).unwrap_or(false);
    format!(
        "{}: headers {headers}; methods {}; paths {}; plain HTTP {}",
        field(r, "host"),
        list("methods"),
        list("paths"),
        if plain { "yes" } else { "no" }
    )
}

/// Where a CNI attachment came from, from the metadata cube-cni records:
/// `CONTAINER/IFNAME@NETNS` (container id shortened to 12 characters, as
/// runtimes show it); "-" for networks made by VMM launchers.
pub fn cni_cell(metadata: Option<&Json>, ascii: bool) -> String {
    let m = |k: &str| metadata.and_then(|m| m.get(k)).and_then(Json::as_str);
    match (m("cni.container_id"), m("cni.ifname"), m("cni.netns")) {
        (Some(c), Some(i), netns) => {
            let short: String = c.chars().take(12).collect();
            cell(&format!("{short}/{i}@{}", netns.unwrap_or("-")), ascii)
        }
        _ => "-".into(),
    }
}

/// Columns padded to their widest cell; the last column is not padded.
pub fn table(header: Option<&[&str]>, rows: &[Vec<String>]) -> String {
    let ncols = header
        .map(|h| h.len())
        .or_else(|| rows.first().map(Vec::len))
        .unwrap_or(0);
    let mut widths = vec![0usize; ncols];
    let all: Vec<Vec<String>> = header
        .map(|h| h.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .into_iter()
        .chain(rows.iter().cloned())
        .collect();
    for r in &all {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &all {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$} ", w = widths[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

pub fn time_text(secs: i64) -> String {
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02} {:02}:{:02}:{:02} UTC",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// A field's value as display lines (empty lists: `-`).
/// Bits per second as `tc` writes them: "40Mbit", "1.5Gbit", "8000bit".
pub fn human_rate(bps: u64) -> String {
    for (unit, name) in [
        (1_000_000_000_000, "Tbit"),
        (1_000_000_000, "Gbit"),
        (1_000_000, "Mbit"),
        (1000, "Kbit"),
    ] {
        if bps >= unit {
            let v = bps as f64 / unit as f64;
            let s = format!("{v:.3}");
            let s = s.trim_end_matches('0').trim_end_matches('.');
            return format!("{s}{name}");
        }
    }
    format!("{bps}bit")
}

fn value_lines(key: &str, v: &Json, out: &Output) -> Vec<String> {
    let lines: Vec<String> = match (key, v) {
        ("egress_bps" | "ingress_bps", Json::Number(n)) => vec![match n.as_u64() {
            Some(0) => "unlimited".into(),
            Some(b) => human_rate(b),
            None => n.to_string(),
        }],
        ("egress_burst" | "ingress_burst", Json::Number(n)) => {
            vec![
                n.as_u64()
                    .map_or_else(|| n.to_string(), |b| format!("{b} bytes")),
            ]
        }
        ("port_mappings", Json::Array(a)) => a.iter().map(|m| port_line(m, out)).collect(),
        ("egress_rules", Json::Array(a)) => a.iter().map(rule_line).collect(),
        ("routes", Json::Array(a)) => a
            .iter()
            .map(|r| {
                let gw = field(r, "gateway");
                let via = if any_address(&gw) {
                    String::new()
                } else {
                    format!(" via {gw}")
                };
                format!(
                    "{}{via} dev {}",
                    field(r, "destination"),
                    field(r, "device")
                )
            })
            .collect(),
        ("arp_neighbors", Json::Array(a)) => a
            .iter()
            .map(|n| {
                format!(
                    "{} lladdr {} dev {}",
                    field(n, "ip"),
                    field(n, "mac"),
                    field(n, "device")
                )
            })
            .collect(),
        ("traffic", Json::Object(t)) => {
            let n = |k: &str| t.get(k).and_then(Json::as_u64).unwrap_or(0);
            vec![
                format!(
                    "sent {} bytes in {} packets (a GSO packet counts once; {} dropped at the device)",
                    n("tx_bytes"),
                    n("tx_packets"),
                    n("tx_dropped")
                ),
                format!(
                    "received {} bytes in {} packets (a GSO packet counts once; {} dropped at the device)",
                    n("rx_bytes"),
                    n("rx_packets"),
                    n("rx_dropped")
                ),
                format!("{} live flows", n("flows")),
                format!(
                    "dropped by the datapath (spoofed {}, policy {}, malformed {}, no route {}, no port {}, unsupported {}, stale TCP {})",
                    n("drop_spoofed"),
                    n("drop_policy"),
                    n("drop_malformed"),
                    n("drop_no_route"),
                    n("drop_no_port"),
                    n("drop_unsupported"),
                    n("drop_stale_tcp")
                ),
                format!(
                    "flows opened {} to the world, {} from the world (port mappings), {} with the host",
                    n("new_flows_snat"),
                    n("new_flows_portmap"),
                    n("new_flows_host")
                ),
                format!(
                    "of which over IPv6, sent {} bytes in {} packets, received {} bytes in {} packets",
                    n("tx_bytes_ipv6"),
                    n("tx_packets_ipv6"),
                    n("rx_bytes_ipv6"),
                    n("rx_packets_ipv6")
                ),
                format!(
                    "of which over IPv6, dropped (spoofed {}, policy {}, malformed {}, no route {}, no port {}, unsupported {}, stale TCP {}), flows opened {} to the world, {} from the world",
                    n("drop_spoofed_ipv6"),
                    n("drop_policy_ipv6"),
                    n("drop_malformed_ipv6"),
                    n("drop_no_route_ipv6"),
                    n("drop_no_port_ipv6"),
                    n("drop_unsupported_ipv6"),
                    n("drop_stale_tcp_ipv6"),
                    n("new_flows_snat_ipv6"),
                    n("new_flows_portmap_ipv6")
                ),
                format!(
                    "{} DNS queries refused by its domain rules",
                    n("dns_refused")
                ),
            ]
        }
        ("created_unix", Json::Number(n)) => match n.as_i64() {
            Some(t) => vec![format!("{} ({t})", time_text(t))],
            None => vec![n.to_string()],
        },
        (_, Json::Bool(b)) => vec![if *b { "yes" } else { "no" }.into()],
        (_, Json::Array(a)) => a
            .iter()
            .map(|x| match x {
                Json::Object(o) => o.values().map(jstr).collect::<Vec<_>>().join(" "),
                Json::Array(parts) => parts.iter().map(jstr).collect::<Vec<_>>().join(" "),
                other => jstr(other),
            })
            .collect(),
        (_, Json::Object(o)) => o.iter().map(|(k, v)| format!("{k}={}", jstr(v))).collect(),
        (_, other) => vec![jstr(other)],
    };
    if lines.is_empty() {
        vec!["-".into()]
    } else {
        lines.iter().map(|l| text(l, out.ascii)).collect()
    }
}

/// The bandwidth shaper's counters of each direction with a limit (or
/// with counts: a limit just removed): its HTB classes' statistics. Their
/// unit differs from the lines above: the device and the datapath count a
/// GSO packet (up to 64 KiB) once, HTB counts the segments it goes on the
/// wire as (what the metrics' `sandbox_shaped_packets` count); a drop of
/// a full queue is one queued packet.
fn shaper_lines(net: &Map<String, Json>, traffic: &Json, out: &Output) -> Vec<String> {
    let n = |k: &str| traffic.get(k).and_then(Json::as_u64).unwrap_or(0);
    let mut lines = vec![];
    for (dir, verb) in [("egress", "sent"), ("ingress", "received")] {
        let limit = net
            .get(&format!("{dir}_bps"))
            .and_then(Json::as_u64)
            .unwrap_or(0);
        let keys = [
            "shaped_bytes",
            "shaped_packets",
            "delayed",
            "rate_dropped_packets",
        ]
        .map(|k| n(&format!("{dir}_{k}")));
        if limit == 0 && keys.iter().all(|&v| v == 0) {
            continue;
        }
        let limit = if limit == 0 {
            "no limit now".to_owned()
        } else {
            human_rate(limit)
        };
        lines.push(text(
            &format!(
                "{dir} shaper ({limit}): {verb} {} bytes in {} (wire packets: a GSO packet \
                 counts per segment), held back {}, {} dropped with its queue full",
                keys[0],
                count(keys[1] as usize, "segment"),
                count(keys[2] as usize, "time"),
                count(keys[3] as usize, "packet"),
            ),
            out.ascii,
        ));
    }
    lines
}

/// Known fields of a network in display order with their labels; others
/// follow by key.
pub const NETWORK_FIELDS: &[(&str, &str)] = &[
    ("sandbox_id", "Sandbox"),
    ("network_handle", "Handle"),
    ("sandbox_ip", "Sandbox IP"),
    ("tap_name", "TAP"),
    ("tap_ifindex", "TAP ifindex"),
    ("mtu", "MTU"),
    ("guest_ip", "Guest IP"),
    ("gateway_ip", "Gateway IP"),
    ("guest_mac", "Guest MAC"),
    ("gateway_mac", "Gateway MAC"),
    ("sandbox_ipv6", "Sandbox IPv6"),
    ("guest_ipv6", "Guest IPv6"),
    ("gateway_ipv6", "Gateway IPv6"),
    ("ipv6_egress", "IPv6 egress"),
    ("port_mappings", "Ports"),
    ("allow_internet_access", "Internet"),
    ("allow_out", "Allow out"),
    ("deny_out", "Deny out"),
    ("egress_mode", "Egress mode"),
    ("egress_rules", "Egress rules"),
    ("egress_bps", "Egress limit"),
    ("egress_burst", "Egress burst"),
    ("ingress_bps", "Ingress limit"),
    ("ingress_burst", "Ingress burst"),
    ("routes", "Routes"),
    ("arp_neighbors", "ARP neighbors"),
    ("metadata", "Metadata"),
    ("idempotency_key", "Idempotency key"),
    ("cloned_from", "Cloned from"),
    ("paused", "Paused"),
    ("attach", "Attach"),
    ("ifname", "Interface"),
    ("netns", "Namespace"),
    ("mapping_wins", "Mappings win"),
    ("created_unix", "Created"),
    ("traffic", "Traffic"),
];

pub const REPORT_FIELDS: &[(&str, &str)] = &[
    ("checked", "Checked"),
    ("repaired", "Repaired"),
    ("removed", "Removed"),
    ("errors", "Errors"),
];

/// `Label: value` lines, labels right-aligned like `networkctl status`;
/// continuation lines of multi-line values are indented to match.
pub fn key_values(obj: &Map<String, Json>, fields: &[(&str, &str)], out: &Output) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![];
    for (key, label) in fields {
        if let Some(v) = obj.get(*key) {
            let mut lines = value_lines(key, v, out);
            if *key == "traffic" {
                lines.extend(shaper_lines(obj, v, out));
            }
            // "IPv6 egress: no (why, and what opens it)".
            if *key == "ipv6_egress"
                && let Some(why) = obj.get("ipv6_egress_reason").and_then(Json::as_str)
            {
                lines = vec![text(&format!("{} ({why})", lines.join(" ")), out.ascii)];
            }
            rows.push(((*label).to_owned(), lines));
        }
    }
    for (key, v) in obj {
        // Shown with `ipv6_egress`.
        if key == "ipv6_egress_reason" {
            continue;
        }
        if !fields.iter().any(|(k, _)| k == key) {
            rows.push((text(key, out.ascii), value_lines(key, v, out)));
        }
    }
    let width = rows
        .iter()
        .map(|(l, _)| l.chars().count())
        .max()
        .unwrap_or(0);
    let mut s = String::new();
    for (label, lines) in rows {
        for (i, line) in lines.iter().enumerate() {
            if i == 0 {
                s.push_str(&format!("{label:>width$}: {line}\n"));
            } else {
                s.push_str(&format!("{:width$}  {line}\n", ""));
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TEXT: Output = Output {
        json: JsonMode::Off,
        legend: true,
        quiet: false,
        ascii: false,
    };
    const ASCII: Output = Output {
        ascii: true,
        ..TEXT
    };

    #[test]
    fn dates() {
        assert_eq!(time_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(time_text(1_714_564_800), "2024-05-01 12:00:00 UTC");
    }

    #[test]
    fn locale() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!locale_is_utf8(env(&[])));
        assert!(!locale_is_utf8(env(&[("LANG", "C")])));
        assert!(!locale_is_utf8(env(&[("LANG", "POSIX")])));
        assert!(locale_is_utf8(env(&[("LANG", "C.UTF-8")])));
        assert!(locale_is_utf8(env(&[("LANG", "en_US.utf8")])));
        assert!(!locale_is_utf8(env(&[
            ("LANG", "en_US.UTF-8"),
            ("LC_ALL", "C")
        ])));
        assert!(locale_is_utf8(env(&[
            ("LANG", "C"),
            ("LC_CTYPE", "de_DE.UTF-8"),
            ("LC_ALL", "")
        ])));
    }

    #[test]
    fn cells_are_single_tokens() {
        assert_eq!(cell("", false), "-");
        assert_eq!(cell("a b\tc", false), "a\\x20b\\x09c");
        assert_eq!(cell("a\\b", false), "a\\\\b");
        assert_eq!(cell("é", false), "é");
        assert_eq!(cell("é", true), "\\xc3\\xa9");
        assert_eq!(text("tcp 80 → 1", true), "tcp 80 \\xe2\\x86\\x92 1");
        assert_eq!(text("a\nb", false), "a\\x0ab");
        let pm = json!([
            {"protocol": "tcp", "container_port": 80, "host_port": 20000, "host_ip": "0.0.0.0"},
            {"protocol": "udp", "container_port": 53, "host_port": 25053, "host_ip": "127.0.0.1"},
        ]);
        assert_eq!(
            ports_cell(Some(&pm), true),
            "tcp:80:20000,udp:53:25053:127.0.0.1"
        );
        assert_eq!(ports_cell(Some(&json!([])), true), "-");
        assert_eq!(ports_cell(None, true), "-");
        assert_eq!(port_line(&pm[0], &TEXT), "tcp 80 → 20000");
        assert_eq!(port_line(&pm[1], &ASCII), "udp 53 -> 127.0.0.1:25053");
        let md = json!({"cni.container_id": "0123456789abcdef", "cni.ifname": "eth0", "cni.netns": "/run/netns/a b"});
        assert_eq!(
            cni_cell(Some(&md), true),
            "0123456789ab/eth0@/run/netns/a\\x20b"
        );
    }

    #[test]
    fn plurals() {
        assert_eq!(count(0, "network"), "0 networks");
        assert_eq!(count(1, "network"), "1 network");
        assert_eq!(count(2, "network"), "2 networks");
    }

    #[test]
    fn shaper_counters_show_with_a_limit_in_their_unit() {
        let t = json!({"tx_bytes": 1, "egress_shaped_bytes": 3000, "egress_shaped_packets": 2,
            "egress_delayed": 5, "egress_rate_dropped_packets": 1});
        let n =
            json!({"sandbox_id": "s", "egress_bps": 10_000_000, "ingress_bps": 0, "traffic": t});
        let s = key_values(n.as_object().unwrap(), NETWORK_FIELDS, &ASCII);
        assert!(
            s.contains(
                "egress shaper (10Mbit): sent 3000 bytes in 2 segments (wire packets: a GSO \
                 packet counts per segment), held back 5 times, 1 packet dropped with its \
                 queue full"
            ),
            "{s}"
        );
        assert!(!s.contains("ingress shaper"), "no ingress limit: {s}");
        let n = json!({"sandbox_id": "s", "egress_bps": 0, "traffic": {"tx_bytes": 1}});
        let s = key_values(n.as_object().unwrap(), NETWORK_FIELDS, &ASCII);
        assert!(!s.contains("shaper"), "{s}");
    }

    #[test]
    fn egress_rules_show_names_and_digests() {
        let n = json!({"sandbox_id": "s", "egress_rules": [
            {"host": "api.test", "set_headers": {"authorization": "sha256:0123456789ab",
             "x-key": "sha256:ba9876543210"}, "methods": ["GET", "POST"], "paths": ["/v1"],
             "plain_http": true},
            {"host": "*.mirror.test", "set_headers": {}, "methods": [], "paths": [],
             "plain_http": false}]});
        let s = key_values(n.as_object().unwrap(), NETWORK_FIELDS, &TEXT);
        assert!(
            s.contains(
                "Egress rules: api.test: headers authorization=sha256:0123456789ab, \
                 x-key=sha256:ba9876543210; methods GET, POST; paths /v1; plain HTTP yes\n"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "              *.mirror.test: headers none; methods any; paths any; plain HTTP no\n"
            ),
            "{s}"
        );
        let none = json!({"sandbox_id": "s", "egress_rules": []});
        let s = key_values(none.as_object().unwrap(), NETWORK_FIELDS, &TEXT);
        assert!(s.contains("Egress rules: -\n"), "{s}");
    }

    #[test]
    fn no_ipv6_egress_says_why() {
        let n = json!({"sandbox_id": "s", "ipv6_egress": false,
            "ipv6_egress_reason": "its rules are IPv4 CIDRs only"});
        let s = key_values(n.as_object().unwrap(), NETWORK_FIELDS, &ASCII);
        assert!(
            s.contains("IPv6 egress: no (its rules are IPv4 CIDRs only)\n"),
            "{s}"
        );
        assert!(!s.contains("ipv6_egress_reason"), "{s}");
    }

    #[test]
    fn status_lines_name_the_struct_fields() {
        let n = json!({
            "sandbox_id": "s",
            "routes": [{"destination": "0.0.0.0/0", "gateway": "169.254.68.5", "device": "eth0"}],
            "arp_neighbors": [{"ip": "169.254.68.5", "mac": "20:90:6f:cf:cf:cf", "device": "eth0"}],
        });
        let s = key_values(n.as_object().unwrap(), NETWORK_FIELDS, &ASCII);
        assert!(s.contains("0.0.0.0/0 via 169.254.68.5 dev eth0"), "{s}");
        assert!(
            s.contains("169.254.68.5 lladdr 20:90:6f:cf:cf:cf dev eth0"),
            "{s}"
        );
    }
}
