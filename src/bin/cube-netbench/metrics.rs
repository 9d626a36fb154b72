//! Scrape rounds: the agent's metrics and report read over its varlink
//! socket, and what a scrape costs.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::calls::Result;
use crate::env::Env;
use crate::report::{Row, row};

/// One varlink call on `path`; every reply until the last (`continues`).
pub(crate) fn varlink_call(
    path: &Path,
    method: &str,
    more: bool,
) -> Result<Vec<serde_json::Value>> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let call = serde_json::json!({"method": method, "more": more});
    s.write_all(format!("{call}\0").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut out = vec![];
    loop {
        let mut buf = vec![];
        r.read_until(0, &mut buf).map_err(|e| e.to_string())?;
        if buf.pop() != Some(0) {
            return Err(format!("{method}: connection closed"));
        }
        let v: serde_json::Value = serde_json::from_slice(&buf).map_err(|e| e.to_string())?;
        if let Some(e) = v.get("error") {
            return Err(format!("{method}: {e}"));
        }
        let more = v.get("continues").and_then(serde_json::Value::as_bool) == Some(true);
        out.push(v);
        if !more {
            return Ok(out);
        }
    }
}

/// Full scrapes of the metrics socket with `n` networks: the agent's CPU
/// per scrape (every thread's schedstat), OpenMetrics and io.systemd.Metrics,
/// in `ROUNDS` rounds, each `SCRAPES` scrapes of one format then of the
/// other; the target holds only if every round's mean meets it.
pub(crate) fn scrape_rows(env: &Env, dir: &Path, n: usize, rows: &mut Vec<Row>) -> Result<()> {
    const ROUNDS: usize = 3;
    const SCRAPES: u32 = 3;
    // The fill's background work (pool refill, heap trim) must not be
    // billed to the first scrape.
    std::thread::sleep(Duration::from_secs(2));
    let sock = dir.join("report.sock");
    let formats = [
        (
            "OpenMetrics",
            "org.cube.NetworkAgent.Metrics.OpenMetrics",
            false,
        ),
        ("io.systemd.Metrics.List", "io.systemd.Metrics.List", true),
    ];
    // Per format: (agent CPU ms per round, wall ms per round, replies).
    let mut seen = [
        (Vec::new(), Vec::new(), 0usize),
        (Vec::new(), Vec::new(), 0),
    ];
    for _ in 0..ROUNDS {
        for ((_, method, more), (cpus, walls, size)) in formats.iter().zip(seen.iter_mut()) {
            let (mut cpu, mut wall) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..SCRAPES {
                let c0 = env.agent_cpu()?;
                let t0 = Instant::now();
                let replies = varlink_call(&sock, method, *more)?;
                wall += t0.elapsed();
                cpu += env.agent_cpu()? - c0;
                *size = replies.len();
            }
            cpus.push(cpu.as_secs_f64() * 1e3 / f64::from(SCRAPES));
            walls.push(wall.as_secs_f64() * 1e3 / f64::from(SCRAPES));
        }
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for ((what, _, _), (cpus, walls, size)) in formats.iter().zip(seen.iter()) {
        rows.push(
            row(
                format!("metrics scrape, {what}, {n} nets: agent CPU / wall, {ROUNDS} rounds of {SCRAPES}"),
                format!("{} ms / {} ms ({size} replies)", list(cpus), list(walls)),
                "-",
                "-",
                "agent CPU <= 50 ms in every round",
            )
            .met(cpus.iter().all(|&c| c <= 50.0)),
        );
    }
    Ok(())
}
