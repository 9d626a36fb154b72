//! The numbers and the table: latency samples (`Lat`), rows against
//! the SPEC §10 targets, and the machine's facts.

use std::fs::{self};
use std::time::Duration;

/// Sorted latency samples.
pub(crate) struct Lat(pub(crate) Vec<Duration>);

impl Lat {
    pub(crate) fn new(mut v: Vec<Duration>) -> Lat {
        v.sort();
        Lat(v)
    }
    pub(crate) fn pct(&self, p: usize) -> f64 {
        let i = (self.0.len() * p / 100).min(self.0.len() - 1);
        self.0[i].as_secs_f64() * 1e6
    }
    pub(crate) fn p50(&self) -> f64 {
        self.pct(50)
    }
    pub(crate) fn p99(&self) -> f64 {
        self.pct(99)
    }
    pub(crate) fn max(&self) -> f64 {
        self.pct(100)
    }
    pub(crate) fn show(&self) -> String {
        format!("{:.0} / {:.0} µs", self.p50(), self.p99())
    }
}

pub(crate) struct Row {
    pub(crate) metric: String,
    pub(crate) value: String,
    pub(crate) floor: String,
    pub(crate) ratio: String,
    pub(crate) target: String,
    /// Whether the SPEC §10 target was met; None: no target (or a floor).
    pub(crate) met: Option<bool>,
}

impl Row {
    /// Marks the row's target as met or missed (shown in the table, and a
    /// miss sets exit code 3).
    pub(crate) fn met(mut self, met: bool) -> Row {
        self.met = Some(met);
        self.target = format!("{} ({})", self.target, if met { "met" } else { "MISSED" });
        self
    }
}

pub(crate) fn row(
    metric: impl Into<String>,
    value: impl Into<String>,
    floor: impl Into<String>,
    ratio: impl Into<String>,
    target: impl Into<String>,
) -> Row {
    Row {
        metric: metric.into(),
        value: value.into(),
        floor: floor.into(),
        ratio: ratio.into(),
        target: target.into(),
        met: None,
    }
}

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

pub(crate) fn ratio(value: f64, floor: f64) -> String {
    format!("{:.1}x", value / floor)
}

pub(crate) fn print_table(rows: &[Row]) {
    let w = |f: fn(&Row) -> &String, h: &str| {
        rows.iter()
            .map(|r| f(r).chars().count())
            .max()
            .unwrap_or(0)
            .max(h.len())
    };
    let (w0, w1, w2, w3) = (
        w(|r| &r.metric, "metric"),
        w(|r| &r.value, "value"),
        w(|r| &r.floor, "floor"),
        w(|r| &r.ratio, "ratio"),
    );
    let line = |a: &str, b: &str, c: &str, d: &str, e: &str| {
        let pad =
            |s: &str, n: usize| format!("{s}{}", " ".repeat(n.saturating_sub(s.chars().count())));
        println!(
            "{}  {}  {}  {}  {e}",
            pad(a, w0),
            pad(b, w1),
            pad(c, w2),
            pad(d, w3)
        );
    };
    line("metric", "value", "floor", "ratio", "target (SPEC §10)");
    for r in rows {
        line(&r.metric, &r.value, &r.floor, &r.ratio, &r.target);
    }
}

pub(crate) fn machine_facts() {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let model = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    println!(
        "machine: nproc {cpus}, kernel {}, cpu {model}",
        kernel.trim()
    );
    println!(
        "load average at start: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}
