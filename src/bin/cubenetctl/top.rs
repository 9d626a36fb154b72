//! `cubenetctl top`: every sandbox's traffic rate, refreshed. Two samples
//! of `io.systemd.Metrics.List` on the agent's metrics socket, an interval
//! apart, give the rates; the table is sorted by bytes per second.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use serde_json::Value as Json;

use crate::args::TopOpts;
use crate::failure::{EXIT_OK, EXIT_UNREACHABLE, Failure, Res};
use crate::output::{Output, emit};
use crate::varlink::Varlink;

/// One sandbox's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counters {
    tx_bytes: f64,
    rx_bytes: f64,
    tx_packets: f64,
    rx_packets: f64,
    drops: f64,
    flows: f64,
}

/// Every sandbox's counters from one `List` stream.
fn sample(path: &Path) -> Res<HashMap<String, Counters>> {
    let mut v = Varlink::connect_report(path)?;
    v.call("io.systemd.Metrics.List", true)?;
    let mut out: HashMap<String, Counters> = HashMap::new();
    loop {
        let Some(r) = v.recv()? else {
            return Err(Failure::new(
                EXIT_UNREACHABLE,
                "the agent closed the metrics stream early",
            ));
        };
        let p = &r.parameters;
        if let (Some(name), Some(obj)) = (
            p.get("name").and_then(Json::as_str),
            p.get("object").and_then(Json::as_str),
        ) {
            let value = p.get("value").and_then(Json::as_f64).unwrap_or(0.0);
            let dir = p
                .get("fields")
                .and_then(|f| f.get("direction"))
                .and_then(Json::as_str);
            let c = out.entry(obj.to_owned()).or_default();
            match (name.rsplit('.').next().unwrap_or(""), dir) {
                ("sandbox_bytes", Some("tx")) => c.tx_bytes = value,
                ("sandbox_bytes", Some("rx")) => c.rx_bytes = value,
                ("sandbox_packets", Some("tx")) => c.tx_packets = value,
                ("sandbox_packets", Some("rx")) => c.rx_packets = value,
                ("sandbox_drops", _) => c.drops += value,
                ("sandbox_flows", _) => c.flows = value,
                _ => {}
            }
        }
        if !r.continues {
            return Ok(out);
        }
    }
}

/// Bytes per second, short: 512B, 12.3K, 4.5M, 1.2G.
fn rate(v: f64, ascii_unit: &str) -> String {
    let (n, unit) = match v {
        v if v >= 1e9 => (v / 1e9, "G"),
        v if v >= 1e6 => (v / 1e6, "M"),
        v if v >= 1e3 => (v / 1e3, "K"),
        v => (v, ""),
    };
    if unit.is_empty() {
        format!("{n:.0}{ascii_unit}")
    } else {
        format!("{n:.1}{unit}{ascii_unit}")
    }
}

fn table(
    before: &HashMap<String, Counters>,
    now: &HashMap<String, Counters>,
    secs: f64,
    out: &Output,
) -> String {
    // (id, tx B/s, rx B/s, tx pkt/s, rx pkt/s, drops/s, flows)
    let mut rows: Vec<(String, f64, f64, f64, f64, f64, f64)> = now
        .iter()
        .map(|(id, c)| {
            let b = before.get(id).copied().unwrap_or(*c);
            // A counter that went down (a recreated TAP) restarts at 0.
            let d = |x: f64, y: f64| if x >= y { (x - y) / secs } else { x / secs };
            (
                id.clone(),
                d(c.tx_bytes, b.tx_bytes),
                d(c.rx_bytes, b.rx_bytes),
                d(c.tx_packets, b.tx_packets),
                d(c.rx_packets, b.rx_packets),
                d(c.drops, b.drops),
                c.flows,
            )
        })
        .collect();
    rows.sort_by(|a, b| {
        (b.1 + b.2)
            .total_cmp(&(a.1 + a.2))
            .then_with(|| a.0.cmp(&b.0))
    });
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(7).max(7);
    let mut s = String::new();
    if out.legend {
        s.push_str(&format!(
            "{:width$} {:>9} {:>9} {:>9} {:>9} {:>8} {:>6}\n",
            "SANDBOX", "TX/s", "RX/s", "TXPKT/s", "RXPKT/s", "DROPS/s", "FLOWS"
        ));
    }
    for r in &rows {
        s.push_str(&format!(
            "{:width$} {:>9} {:>9} {:>9.0} {:>9.0} {:>8.0} {:>6.0}\n",
            r.0,
            rate(r.1, "B"),
            rate(r.2, "B"),
            r.3,
            r.4,
            r.5,
            r.6
        ));
    }
    if out.legend && !out.quiet {
        s.push_str(&format!(
            "{} {}, rates over {secs:.1} s.\n",
            rows.len(),
            if rows.len() == 1 {
                "sandbox"
            } else {
                "sandboxes"
            }
        ));
    }
    s
}

pub fn run(o: &TopOpts, out: &Output) -> Res<u8> {
    use std::io::IsTerminal;
    let tty = std::io::stdout().is_terminal();
    let mut before = sample(&o.report)?;
    let mut at = Instant::now();
    let mut shown = 0u32;
    loop {
        std::thread::sleep(o.interval);
        let now = sample(&o.report)?;
        let secs = at.elapsed().as_secs_f64().max(1e-3);
        at = Instant::now();
        let t = table(&before, &now, secs, out);
        if tty {
            // Home and clear: each table replaces the last.
            emit(&format!("\x1b[H\x1b[2J{t}"));
        } else {
            emit(&if shown == 0 { t } else { format!("\n{t}") });
        }
        before = now;
        shown += 1;
        if o.count.is_some_and(|n| shown >= n) {
            return Ok(EXIT_OK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::JsonMode;

    #[test]
    fn busiest_first_with_rates() {
        let c = |tx: f64, rx: f64| Counters {
            tx_bytes: tx,
            rx_bytes: rx,
            ..Default::default()
        };
        let before = HashMap::from([
            ("a".to_string(), c(0.0, 0.0)),
            ("b".to_string(), c(0.0, 0.0)),
        ]);
        let now = HashMap::from([
            ("a".to_string(), c(100.0, 0.0)),
            ("b".to_string(), c(0.0, 4000.0)),
        ]);
        let out = Output {
            json: JsonMode::Off,
            legend: true,
            quiet: false,
            ascii: true,
        };
        let t = table(&before, &now, 2.0, &out);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("SANDBOX"), "{t}");
        assert!(
            lines[1].starts_with("b ") && lines[1].contains("2.0KB"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("a ") && lines[2].contains("50B"),
            "{t}"
        );
        assert_eq!(lines[3], "2 sandboxes, rates over 2.0 s.");
    }
}
