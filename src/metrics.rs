//! Metrics: one model, two renderings. The agent describes what it knows
//! as metric families (counters, gauges, strings, histograms); systemd's
//! `io.systemd.Metrics` varlink interface (what `systemd-report` collects)
//! and OpenMetrics text (Prometheus: `cubenetctl metrics`, node_exporter's
//! textfile collector) are both renderings of that list, so they can never
//! disagree. docs/observability.md lists every family with its definition.

use std::fmt::Write as _;
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
/// fields (e.g. `direction`, `reason`).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub object: Option<String>,
    pub fields: Vec<(&'static str, String)>,
    pub value: Val,
}

impl Sample {
    pub fn node(value: Val) -> Self {
        Self {
            object: None,
            fields: vec![],
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

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

fn bound(b: f64) -> String {
    // OpenMetrics canonical floats: "0.001", "1.0".
    let s = format!("{b}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// The OpenMetrics text exposition of `families` (ends with `# EOF`).
pub fn openmetrics(families: &[Family]) -> String {
    let mut o =
        String::with_capacity(128 + families.iter().map(|f| f.samples.len() * 96).sum::<usize>());
    for f in families {
        let name = match (f.kind, f.unit) {
            (_, Some(u)) if !f.name.ends_with(u) => format!("{OPENMETRICS_PREFIX}{}_{u}", f.name),
            _ => format!("{OPENMETRICS_PREFIX}{}", f.name),
        };
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::String => "info",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(o, "# TYPE {name} {kind}");
        if let Some(u) = f.unit {
            let _ = writeln!(o, "# UNIT {name} {u}");
        }
        let _ = writeln!(o, "# HELP {name} {}", escape(f.help));
        for s in &f.samples {
            let mut labels: Vec<String> = vec![];
            if let Some(obj) = &s.object {
                labels.push(format!("sandbox_id=\"{}\"", escape(obj)));
            }
            for (k, v) in &s.fields {
                labels.push(format!("{k}=\"{}\"", escape(v)));
            }
            let with = |extra: Option<String>| {
                let mut l = labels.clone();
                l.extend(extra);
                if l.is_empty() {
                    String::new()
                } else {
                    format!("{{{}}}", l.join(","))
                }
            };
            match (&s.value, f.kind) {
                (Val::U(v), Kind::Counter) => {
                    let _ = writeln!(o, "{name}_total{} {v}", with(None));
                }
                (Val::U(v), _) => {
                    let _ = writeln!(o, "{name}{} {v}", with(None));
                }
                (Val::S(text), _) => {
                    let _ = writeln!(
                        o,
                        "{name}_info{} 1",
                        with(Some(format!("value=\"{}\"", escape(text))))
                    );
                }
                (Val::H(h), _) => {
                    for (i, c) in h.cumulative.iter().enumerate() {
                        let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| bound(*b));
                        let _ =
                            writeln!(o, "{name}_bucket{} {c}", with(Some(format!("le=\"{le}\""))));
                    }
                    let _ = writeln!(o, "{name}_sum{} {}", with(None), h.sum_seconds);
                    let _ = writeln!(
                        o,
                        "{name}_count{} {}",
                        with(None),
                        h.cumulative.last().copied().unwrap_or(0)
                    );
                }
            }
        }
    }
    o.push_str("# EOF\n");
    o
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

/// `io.systemd.Metrics.List` replies: one per value.
pub fn list(families: &[Family]) -> Vec<Value> {
    let mut out = vec![];
    for f in families {
        for s in &f.samples {
            let one = |suffix: &str, value: Value, extra: Option<(&str, String)>| {
                let mut v = json!({
                    "name": format!("{SYSTEMD_PREFIX}{}{suffix}", f.name),
                    "value": value,
                });
                if let Some(o) = &s.object {
                    v["object"] = json!(o);
                }
                let mut fields: serde_json::Map<String, Value> = s
                    .fields
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), json!(v)))
                    .collect();
                if let Some((k, x)) = extra {
                    fields.insert(k.to_owned(), json!(x));
                }
                if !fields.is_empty() {
                    v["fields"] = Value::Object(fields);
                }
                v
            };
            match &s.value {
                Val::U(v) => out.push(one("", json!(v), None)),
                Val::S(t) => out.push(one("", json!(t), None)),
                Val::H(h) => {
                    for (i, c) in h.cumulative.iter().enumerate() {
                        let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| bound(*b));
                        out.push(one("_bucket", json!(c), Some(("le", le))));
                    }
                    out.push(one("_sum", json!(h.sum_seconds), None));
                    out.push(one(
                        "_count",
                        json!(h.cumulative.last().copied().unwrap_or(0)),
                        None,
                    ));
                }
            }
        }
    }
    out
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
                    fields: vec![("direction", "tx".into())],
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
        let l = list(&f);
        assert_eq!(l[0]["object"], "a\"b");
        assert_eq!(l[0]["fields"]["direction"], "tx");
        assert_eq!(l[0]["value"], 5);
    }
}
