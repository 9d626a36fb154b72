//! Metrics: one model, two renderings. The agent describes what it knows
//! as metric families (counters, gauges, strings, histograms); systemd's
//! `io.systemd.Metrics` varlink interface (what `systemd-report` collects)
//! and OpenMetrics text (Prometheus: `cubenetctl metrics`, node_exporter's
//! textfile collector) are both renderings of that list, so they can never
//! disagree. docs/observability.md lists every family with its definition.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// Prefix of every family name in `io.systemd.Metrics`.
pub const SYSTEMD_PREFIX: &str = "org.cube.NetworkAgent.";
/// Prefix of every family name in OpenMetrics.
pub const OPENMETRICS_PREFIX: &str = "cube_network_agent_";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// A text value (OpenMetrics: an `info` family with the text as a
    /// label and the value 1).
    String,
    /// Cumulative buckets (upper bounds in seconds), sum and count.
    Histogram,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    U(u64),
    S(String),
    H(HistogramSnapshot),
}

/// One value: its object (the sandbox id for per-sandbox families) and
/// its field (e.g. `direction`, `reason`), if any.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub object: Option<std::sync::Arc<str>>,
    pub field: Option<(&'static str, &'static str)>,
    pub value: Val,
}

impl Sample {
    pub fn node(value: Val) -> Self {
        Self {
            object: None,
            field: None,
            value,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    /// snake_case, without prefix; counters without `_total`.
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// The OpenMetrics unit (`bytes`, `seconds`), if any.
    pub unit: Option<&'static str>,
    pub samples: Vec<Sample>,
}

/// Upper bounds of the latency histograms, seconds.
pub const BUCKETS: [f64; 11] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A latency histogram updated from any thread without a lock.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Per bucket (not cumulative), the last one is +Inf.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Cumulative counts per bound of [`BUCKETS`], then +Inf (= count).
    pub cumulative: Vec<u64>,
    pub sum_seconds: f64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                acc += c.load(Ordering::Relaxed);
                acc
            })
            .collect();
        HistogramSnapshot {
            cumulative,
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// EnsureNetwork and ReleaseNetwork latencies (every edge), kept for the
/// process's life.
pub static ENSURE_LATENCY: Histogram = Histogram {
    counts: [const { AtomicU64::new(0) }; BUCKETS.len() + 1],
    sum_ns: AtomicU64::new(0),
};
pub static RELEASE_LATENCY: Histogram = Histogram {
    counts: [const { AtomicU64::new(0) }; BUCKETS.len() + 1],
    sum_ns: AtomicU64::new(0),
};
/// Networks made with `clone_of` since the agent started.
pub static NETWORKS_CLONED: AtomicU64 = AtomicU64::new(0);
/// Clones' networks handed to their first VMM (OpenTap) since the agent
/// started: snapshots restored onto them.
pub static CLONES_RESTORED: AtomicU64 = AtomicU64::new(0);
/// CNI networks the agent released because their container's network
/// namespace was gone and no DEL came, since the agent started.
pub static NETNS_GONE_RELEASED: AtomicU64 = AtomicU64::new(0);
/// TrafficWhilePaused events since the agent started.
pub static PAUSED_TRAFFIC_EVENTS: AtomicU64 = AtomicU64::new(0);

fn bound(b: f64) -> String {
    // OpenMetrics canonical floats: "0.001", "1.0".
    let s = format!("{b}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// Where OpenMetrics text goes: as is, or as the body of a JSON string
/// (the varlink reply carries the text as one string: written escaped in
/// the same pass, never as a second multi-megabyte copy).
pub struct TextOut<'a> {
    buf: &'a mut Vec<u8>,
    json: bool,
}

impl<'a> TextOut<'a> {
    pub fn plain(buf: &'a mut Vec<u8>) -> Self {
        Self { buf, json: false }
    }

    /// Text escaped for a JSON string's body (no quotes around it).
    pub fn json(buf: &'a mut Vec<u8>) -> Self {
        Self { buf, json: true }
    }

    /// Text with no character a JSON string escapes (names, numbers,
    /// label keys): copied as is in both modes.
    fn raw(&mut self, s: &str) {
        debug_assert!(!s.bytes().any(|c| c < 0x20 || c == b'"' || c == b'\\'));
        self.buf.extend_from_slice(s.as_bytes());
    }

    fn push(&mut self, s: &str) {
        if self.json {
            push_json_body(self.buf, s);
        } else {
            self.buf.extend_from_slice(s.as_bytes());
        }
    }

    fn byte(&mut self, b: u8) {
        match b {
            b'\n' if self.json => self.buf.extend_from_slice(b"\\n"),
            b'"' if self.json => self.buf.extend_from_slice(b"\\\""),
            b'\\' if self.json => self.buf.extend_from_slice(b"\\\\"),
            b => self.buf.push(b),
        }
    }
}

/// Appends `s` escaped as the inside of a JSON string: runs without a
/// special character are copied whole.
pub fn push_json_body(o: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    if plain(b) {
        o.extend_from_slice(b);
        return;
    }
    let mut run = 0;
    for (i, &c) in b.iter().enumerate() {
        let esc: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => {
                o.extend_from_slice(&b[run..i]);
                o.extend_from_slice(format!("\\u{c:04x}").as_bytes());
                run = i + 1;
                continue;
            }
            _ => continue,
        };
        o.extend_from_slice(&b[run..i]);
        o.extend_from_slice(esc);
        run = i + 1;
    }
    o.extend_from_slice(&b[run..]);
}

/// Whether `b` has no byte a JSON string or an OpenMetrics label value
/// escapes (control characters, `"`, `\\`): a table lookup per byte, so
/// the common case (sandbox ids, names) is a plain copy.
fn plain(b: &[u8]) -> bool {
    static SPECIAL: [bool; 256] = {
        let mut t = [false; 256];
        let mut c = 0;
        while c < 0x20 {
            t[c] = true;
            c += 1;
        }
        t[b'"' as usize] = true;
        t[b'\\' as usize] = true;
        t
    };
    !b.iter().any(|&c| SPECIAL[usize::from(c)])
}

/// Writes `s` escaped as an OpenMetrics label value.
fn push_escaped(o: &mut TextOut, s: &str) {
    if plain(s.as_bytes()) {
        o.raw(s);
        return;
    }
    for c in s.chars() {
        match c {
            '\\' => o.push("\\\\"),
            '"' => o.push("\\\""),
            '\n' => o.push("\\n"),
            c => o.push(c.encode_utf8(&mut [0; 4])),
        }
    }
}

/// `{sandbox_id="...",field="...",extra}` (nothing if no label).
fn push_labels(o: &mut TextOut, s: &Sample, extra: Option<(&str, &str)>) {
    let mut first = true;
    let mut sep = |o: &mut TextOut| {
        o.byte(if first { b'{' } else { b',' });
        first = false;
    };
    if let Some(obj) = &s.object {
        sep(o);
        o.raw("sandbox_id=");
        o.byte(b'"');
        push_escaped(o, obj);
        o.byte(b'"');
    }
    for (k, v) in s.field.iter().copied().chain(extra) {
        sep(o);
        o.raw(k);
        o.byte(b'=');
        o.byte(b'"');
        push_escaped(o, v);
        o.byte(b'"');
    }
    if !first {
        o.byte(b'}');
    }
}

/// The OpenMetrics text exposition of `families` (ends with `# EOF`).
pub fn openmetrics(families: &[Family]) -> String {
    let mut buf =
        Vec::with_capacity(256 + families.iter().map(|f| f.samples.len() * 80).sum::<usize>());
    let mut o = TextOut::plain(&mut buf);
    for f in families {
        openmetrics_family(f, &mut o);
    }
    openmetrics_end(&mut o);
    String::from_utf8(buf).expect("OpenMetrics text is built from strings")
}

/// The end of an exposition.
pub fn openmetrics_end(o: &mut TextOut) {
    o.push("# EOF");
    o.byte(b'\n');
}

/// One family's OpenMetrics lines.
pub fn openmetrics_family(f: &Family, o: &mut TextOut) {
    openmetrics_header(f, o);
    openmetrics_samples(f, &f.samples, o);
}

/// The family's name as OpenMetrics writes it (prefix, unit).
fn openmetrics_name(f: &Family) -> String {
    match f.unit {
        Some(u) if !f.name.ends_with(u) => format!("{OPENMETRICS_PREFIX}{}_{u}", f.name),
        _ => format!("{OPENMETRICS_PREFIX}{}", f.name),
    }
}

/// A family's `# TYPE`, `# UNIT` and `# HELP` lines.
pub fn openmetrics_header(f: &Family, o: &mut TextOut) {
    let name = openmetrics_name(f);
    let kind = match f.kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
        Kind::String => "info",
        Kind::Histogram => "histogram",
    };
    o.push(&format!("# TYPE {name} {kind}"));
    o.byte(b'\n');
    if let Some(u) = f.unit {
        o.push(&format!("# UNIT {name} {u}"));
        o.byte(b'\n');
    }
    o.raw("# HELP ");
    o.raw(&name);
    o.byte(b' ');
    push_escaped(o, f.help);
    o.byte(b'\n');
}

/// The lines of `samples` (some of family `f`'s). One pass, no allocation
/// per sample: a scrape at 10,000 sandboxes is ~60,000 lines.
pub fn openmetrics_samples(f: &Family, samples: &[Sample], o: &mut TextOut) {
    let mut num = itoa::Buffer::new();
    let name = openmetrics_name(f);
    let total = if f.kind == Kind::Counter {
        format!("{name}_total")
    } else {
        name.clone()
    };
    for s in samples {
        match &s.value {
            Val::U(v) => {
                o.raw(&total);
                push_labels(o, s, None);
                o.byte(b' ');
                o.raw(num.format(*v));
                o.byte(b'\n');
            }
            Val::S(text) => {
                o.raw(&name);
                o.raw("_info");
                push_labels(o, s, Some(("value", text)));
                o.raw(" 1");
                o.byte(b'\n');
            }
            Val::H(h) => {
                for (i, c) in h.cumulative.iter().enumerate() {
                    let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| bound(*b));
                    o.raw(&name);
                    o.raw("_bucket");
                    push_labels(o, s, Some(("le", &le)));
                    o.byte(b' ');
                    o.raw(num.format(*c));
                    o.byte(b'\n');
                }
                o.raw(&name);
                o.raw("_sum");
                push_labels(o, s, None);
                o.raw(&format!(" {}", h.sum_seconds));
                o.byte(b'\n');
                o.raw(&name);
                o.raw("_count");
                push_labels(o, s, None);
                o.byte(b' ');
                o.raw(num.format(h.cumulative.last().copied().unwrap_or(0)));
                o.byte(b'\n');
            }
        }
    }
}

/// `io.systemd.Metrics.Describe` replies: one per family (a histogram is
/// three counter families: `_bucket` with field `le`, `_sum`, `_count`).
pub fn describe(families: &[Family]) -> Vec<Value> {
    let mut out = vec![];
    for f in families {
        let d = |suffix: &str, kind: &str, help: String| {
            json!({
                "name": format!("{SYSTEMD_PREFIX}{}{suffix}", f.name),
                "description": help,
                "type": kind,
            })
        };
        match f.kind {
            Kind::Counter => out.push(d("", "counter", f.help.to_string())),
            Kind::Gauge => out.push(d("", "gauge", f.help.to_string())),
            Kind::String => out.push(d("", "string", f.help.to_string())),
            Kind::Histogram => {
                out.push(d(
                    "_bucket",
                    "counter",
                    format!("{} (calls at most `le` seconds long)", f.help),
                ));
                out.push(d("_sum", "counter", format!("{} (total seconds)", f.help)));
                out.push(d("_count", "counter", format!("{} (calls)", f.help)));
            }
        }
    }
    out
}

/// Writes `s` as a JSON string.
fn push_json_str(o: &mut Vec<u8>, s: &str) {
    o.push(b'"');
    push_json_body(o, s);
    o.push(b'"');
}

/// `io.systemd.Metrics.List` replies, one per value, written as the
/// NUL-terminated varlink messages they are sent as (every one but the
/// last with `"continues":true`); returns how many. Written directly, not
/// built as JSON values first: 10,000 sandboxes are ~100,000 replies.
/// (The report socket streams them with [`ListWriter`].)
pub fn list_into(families: &[Family], out: &mut Vec<u8>) -> usize {
    let mut w = ListWriter::default();
    for f in families {
        w.family(f, out);
    }
    w.count()
}

/// [`list_into`] a family at a time, so a caller can send what is
/// final (every reply but the last, which may still get `continues`)
/// and reuse its buffer: a scrape never holds all its replies at once.
#[derive(Default)]
pub struct ListWriter {
    n: usize,
    last: usize,
}

impl ListWriter {
    /// Replies written so far.
    pub fn count(&self) -> usize {
        self.n
    }

    /// How many bytes at the start of `out` are final.
    pub fn settled(&self) -> usize {
        self.last
    }

    /// The caller removed the first `k` settled bytes from `out`.
    pub fn drained(&mut self, k: usize) {
        self.last -= k;
    }

    fn one(
        &mut self,
        out: &mut Vec<u8>,
        f: &Family,
        suffix: &str,
        s: &Sample,
        value: &[u8],
        extra: Option<(&str, &str)>,
    ) {
        if self.n > 0 {
            // The previous reply was not the last: its closing brace and
            // NUL make room for "continues".
            out.truncate(out.len() - 2);
            out.extend_from_slice(b",\"continues\":true}\0");
        }
        self.last = out.len();
        out.extend_from_slice(b"{\"parameters\":{\"name\":\"");
        out.extend_from_slice(SYSTEMD_PREFIX.as_bytes());
        out.extend_from_slice(f.name.as_bytes());
        out.extend_from_slice(suffix.as_bytes());
        out.extend_from_slice(b"\",\"value\":");
        out.extend_from_slice(value);
        if let Some(o) = &s.object {
            out.extend_from_slice(b",\"object\":");
            push_json_str(out, o);
        }
        let mut first = true;
        for (k, v) in s.field.iter().copied().chain(extra) {
            out.extend_from_slice(if first { b",\"fields\":{" } else { b"," });
            first = false;
            push_json_str(out, k);
            out.push(b':');
            push_json_str(out, v);
        }
        if !first {
            out.push(b'}');
        }
        out.extend_from_slice(b"}}\0");
        self.n += 1;
    }

    /// Appends the replies of family `f`.
    pub fn family(&mut self, f: &Family, out: &mut Vec<u8>) {
        self.samples(f, &f.samples, out);
    }

    /// Appends the replies of `samples` (some of family `f`'s).
    pub fn samples(&mut self, f: &Family, samples: &[Sample], out: &mut Vec<u8>) {
        let mut num = itoa::Buffer::new();
        for s in samples {
            match &s.value {
                Val::U(v) => self.one(out, f, "", s, num.format(*v).as_bytes(), None),
                Val::S(t) => {
                    let mut b = vec![];
                    push_json_str(&mut b, t);
                    self.one(out, f, "", s, &b, None)
                }
                Val::H(h) => {
                    for (i, c) in h.cumulative.iter().enumerate() {
                        let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| bound(*b));
                        let c = num.format(*c);
                        self.one(out, f, "_bucket", s, c.as_bytes(), Some(("le", &le)));
                    }
                    let sum = serde_json::to_vec(&h.sum_seconds).expect("a float serialises");
                    self.one(out, f, "_sum", s, &sum, None);
                    let count = num.format(h.cumulative.last().copied().unwrap_or(0));
                    self.one(out, f, "_count", s, count.as_bytes(), None);
                }
            }
        }
    }
}

/// The `parameters` of every `io.systemd.Metrics.List` reply, parsed back
/// (tests and tools; the socket sends [`list_into`]'s bytes).
pub fn list(families: &[Family]) -> Vec<Value> {
    let mut out = vec![];
    list_into(families, &mut out);
    out.split(|b| *b == 0)
        .filter(|m| !m.is_empty())
        .map(|m| {
            serde_json::from_slice::<Value>(m).expect("list_into writes JSON")["parameters"].take()
        })
        .collect()
}

/// The flow log's families (docs/flows.md), from one read of the hub's
/// counters: per sandbox (label `sandbox_id`) the records made, the
/// datapath's events lost and the records the journal's rate limit
/// suppressed (the last two only above 0); node-wide the same totals and
/// the records watchers lost.
pub fn flow_families(hub: &crate::flows::FlowHub) -> Vec<Family> {
    flow_families_of(hub.stats(), hub.totals())
}

/// [`flow_families`] from `stats` (each sandbox's counters) and `totals`
/// (records, datapath events lost, records watchers lost).
pub fn flow_families_of(
    stats: Vec<(String, crate::flows::SandboxFlowStats)>,
    totals: (u64, u64, u64),
) -> Vec<Family> {
    let family = |name, help| Family {
        name,
        kind: Kind::Counter,
        help,
        unit: None,
        samples: vec![],
    };
    let mut per = [
        family(
            "sandbox_flow_records",
            "Flow log records made for a sandbox (flow starts, ends and refusals) since the agent started",
        ),
        family(
            "sandbox_flow_events_lost",
            "Flow events of a sandbox the datapath did not emit (its rate limit, or the ring full); only values above 0",
        ),
        family(
            "sandbox_flow_journal_suppressed",
            "Flow log records of a sandbox the journal's rate limit suppressed; only values above 0",
        ),
    ];
    for (id, s) in stats {
        let id: std::sync::Arc<str> = id.into();
        for (f, n, sparse) in [
            (0, s.records, false),
            (1, s.lost, true),
            (2, s.journal_suppressed, true),
        ] {
            if sparse && n == 0 {
                continue;
            }
            per[f].samples.push(Sample {
                object: Some(id.clone()),
                field: None,
                value: Val::U(n),
            });
        }
    }
    let (records, lost, watch_lost) = totals;
    let node = |name, help, n| Family {
        samples: vec![Sample::node(Val::U(n))],
        ..family(name, help)
    };
    let mut f: Vec<Family> = per.into();
    f.extend([
        node(
            "flow_records",
            "Flow log records made, every sandbox, since the agent started",
            records,
        ),
        node(
            "flow_events_lost",
            "Flow events the datapath did not emit (a sandbox's rate limit, or the ring full), every sandbox",
            lost,
        ),
        node(
            "flow_watch_lost",
            "Flow log records WatchFlows watchers lost (they read too slowly and their queue filled)",
            watch_lost,
        ),
    ]);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fams() -> Vec<Family> {
        let h = Histogram::default();
        h.observe(Duration::from_micros(700));
        h.observe(Duration::from_millis(30));
        vec![
            Family {
                name: "sandbox",
                kind: Kind::Counter,
                help: "Bytes \"sent\"",
                unit: Some("bytes"),
                samples: vec![Sample {
                    object: Some("a\"b".into()),
                    field: Some(("direction", "tx")),
                    value: Val::U(5),
                }],
            },
            Family {
                name: "networks",
                kind: Kind::Gauge,
                help: "Networks",
                unit: None,
                samples: vec![Sample::node(Val::U(2))],
            },
            Family {
                name: "ensure_network",
                kind: Kind::Histogram,
                help: "EnsureNetwork latency",
                unit: Some("seconds"),
                samples: vec![Sample::node(Val::H(h.snapshot()))],
            },
            Family {
                name: "build",
                kind: Kind::String,
                help: "Version",
                unit: None,
                samples: vec![Sample::node(Val::S("1.0".into()))],
            },
        ]
    }

    #[test]
    fn openmetrics_names_units_escapes_and_eof() {
        let t = openmetrics(&fams());
        assert!(
            t.contains("# TYPE cube_network_agent_sandbox_bytes counter\n"),
            "{t}"
        );
        assert!(
            t.contains("# UNIT cube_network_agent_sandbox_bytes bytes\n"),
            "{t}"
        );
        assert!(
            t.contains(
                "cube_network_agent_sandbox_bytes_total{sandbox_id=\"a\\\"b\",direction=\"tx\"} 5\n"
            ),
            "{t}"
        );
        assert!(t.contains("cube_network_agent_networks 2\n"), "{t}");
        assert!(
            t.contains("cube_network_agent_ensure_network_seconds_bucket{le=\"0.001\"} 1\n"),
            "{t}"
        );
        assert!(
            t.contains("cube_network_agent_ensure_network_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("cube_network_agent_ensure_network_seconds_count 2\n"),
            "{t}"
        );
        assert!(
            t.contains("cube_network_agent_build_info{value=\"1.0\"} 1\n"),
            "{t}"
        );
        assert!(t.ends_with("# EOF\n"));
    }

    #[test]
    fn systemd_rendering_has_a_family_for_every_value() {
        let f = fams();
        let names: Vec<String> = describe(&f)
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_owned())
            .collect();
        for v in list(&f) {
            let n = v["name"].as_str().unwrap();
            assert!(names.iter().any(|d| d == n), "{n} not described");
            assert!(n.starts_with(SYSTEMD_PREFIX));
        }
        let mut raw = vec![];
        let n = list_into(&f, &mut raw);
        let msgs: Vec<Value> = raw
            .split(|b| *b == 0)
            .filter(|m| !m.is_empty())
            .map(|m| serde_json::from_slice(m).unwrap())
            .collect();
        assert_eq!(msgs.len(), n);
        assert!(msgs[..n - 1].iter().all(|m| m["continues"] == true));
        assert!(msgs[n - 1].get("continues").is_none());
        let l = list(&f);
        assert_eq!(l[0]["object"], "a\"b");
        assert_eq!(l[0]["fields"]["direction"], "tx");
        assert_eq!(l[0]["value"], 5);
    }
    #[test]
    fn flow_families_per_sandbox_and_node_wide() {
        use crate::flows::SandboxFlowStats;
        let f = flow_families_of(
            vec![
                (
                    "a".into(),
                    SandboxFlowStats {
                        records: 7,
                        lost: 2,
                        journal_suppressed: 0,
                    },
                ),
                ("b".into(), SandboxFlowStats::default()),
            ],
            (7, 2, 5),
        );
        let t = openmetrics(&f);
        for line in [
            "# TYPE cube_network_agent_sandbox_flow_records counter\n",
            "cube_network_agent_sandbox_flow_records_total{sandbox_id=\"a\"} 7\n",
            "cube_network_agent_sandbox_flow_records_total{sandbox_id=\"b\"} 0\n",
            "cube_network_agent_sandbox_flow_events_lost_total{sandbox_id=\"a\"} 2\n",
            "# TYPE cube_network_agent_sandbox_flow_journal_suppressed counter\n",
            "cube_network_agent_flow_records_total 7\n",
            "cube_network_agent_flow_events_lost_total 2\n",
            "cube_network_agent_flow_watch_lost_total 5\n",
        ] {
            assert!(t.contains(line), "{line}: {t}");
        }
        assert!(
            !t.contains("flow_events_lost_total{sandbox_id=\"b\"}"),
            "{t}"
        );
        assert!(!t.contains("journal_suppressed_total{"), "{t}");
        let names: Vec<String> = describe(&f)
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_owned())
            .collect();
        for n in [
            "sandbox_flow_records",
            "sandbox_flow_events_lost",
            "sandbox_flow_journal_suppressed",
            "flow_records",
            "flow_events_lost",
            "flow_watch_lost",
        ] {
            assert!(
                names.contains(&format!("{SYSTEMD_PREFIX}{n}")),
                "{n}: {names:?}"
            );
        }
        let l = list(&f);
        assert_eq!(l[0]["object"], "a");
        assert_eq!(l[0]["value"], 7);
    }
}
