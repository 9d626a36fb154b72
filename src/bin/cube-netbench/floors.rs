//! The raw floors measured in the same run: zbus Ping, OpenTap, fdatasync,
//! journal append, TAP create, calls/s; and the bus floor server
//! (`floor.rs`, run as a process of its own) with the CPU a pair costs.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_network_agent::tap::Tap;
use zbus::Connection;

use crate::calls::{Result, Target, ensure, ensure_at, open_tap, ping, release, release_at, timed};
use crate::env::{Env, machine_cpu, process_cpu};
use crate::floor;
use crate::report::Lat;

pub(crate) async fn floor_ping(conn: &Connection, samples: usize) -> Result<Lat> {
    for _ in 0..50 {
        ping(conn).await?;
    }
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        v.push(timed(ping(conn)).await?);
    }
    Ok(Lat::new(v))
}

pub(crate) async fn floor_open_tap(conn: &Connection, samples: usize) -> Result<Lat> {
    ensure(conn, "bench-fd-0").await?;
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        v.push(timed(open_tap(conn, "bench-fd-0")).await?);
    }
    release(conn, "bench-fd-0").await?;
    Ok(Lat::new(v))
}

/// Ping calls/s with `callers` concurrent tasks on one connection.
pub(crate) async fn ping_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, _, _| async move {
        ping(&conn).await
    })
    .await
}

/// Operations per second over `secs`: `callers` tasks on one connection each
/// run `op(conn, caller, iteration)` in a loop until the deadline.
pub(crate) async fn rate<F, Fut>(conn: &Connection, callers: usize, secs: f64, op: F) -> Result<f64>
where
    F: Fn(Connection, usize, usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let op = &op;
    per_second(callers, secs, |c, deadline| {
        let conn = conn.clone();
        async move {
            let mut n = 0usize;
            while Instant::now() < deadline {
                op(conn.clone(), c, n).await?;
                n += 1;
            }
            Ok(n)
        }
    })
    .await
}

/// Operations per second of `callers` tasks, each `task(caller, deadline)`
/// returning how many it did before the deadline.
pub(crate) async fn per_second<T, Fut>(callers: usize, secs: f64, task: T) -> Result<f64>
where
    T: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = Result<usize>>,
{
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let total: usize = futures::future::try_join_all((0..callers).map(|c| task(c, deadline)))
        .await?
        .into_iter()
        .sum();
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// write tmp, fsync, rename, fsync dir — what one durable record costs.
pub(crate) fn floor_durable_write(dir: &Path, samples: usize) -> Result<Lat> {
    let data = [0x5au8; 1024];
    let d = File::open(dir).map_err(|e| e.to_string())?;
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        let tmp = dir.join(format!("rec-{i}.tmp"));
        let dst = dir.join(format!("rec-{}", i % 16));
        let t = Instant::now();
        let mut f = File::create(&tmp).map_err(|e| e.to_string())?;
        f.write_all(&data).map_err(|e| e.to_string())?;
        f.sync_all().map_err(|e| e.to_string())?;
        fs::rename(&tmp, &dst).map_err(|e| e.to_string())?;
        d.sync_all().map_err(|e| e.to_string())?;
        v.push(t.elapsed());
    }
    Ok(Lat::new(v))
}

/// 1 KB append + fdatasync to one journal file — what the agent's store
/// pays per commit (SPEC: "append + fdatasync journal").
pub(crate) fn floor_journal_append(dir: &Path, samples: usize) -> Result<Lat> {
    let data = [0xa5u8; 1024];
    let mut f = File::create(dir.join("journal")).map_err(|e| e.to_string())?;
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        f.write_all(&data).map_err(|e| e.to_string())?;
        f.sync_data().map_err(|e| e.to_string())?;
        v.push(t.elapsed());
    }
    Ok(Lat::new(v))
}

/// TUNSETIFF in a private namespace owned by a dedicated thread; the
/// namespace (and its TAPs) goes away when the thread exits.
pub(crate) fn floor_tap_create(samples: usize) -> Result<Lat> {
    std::thread::spawn(move || {
        // SAFETY: unshare only changes this thread's namespace membership
        // (CLONE_NEWNET is per thread); no memory is involved.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut taps = Vec::with_capacity(samples);
        let mut v = Vec::with_capacity(samples);
        for i in 0..samples {
            let name = format!("cnbt{i}");
            let t = Instant::now();
            let tap = Tap::create(&name).map_err(|e| cube_network_agent::error_chain(&e))?;
            v.push(t.elapsed());
            taps.push(tap);
        }
        Ok(Lat::new(v))
    })
    .join()
    .map_err(|_| "TAP floor thread panicked".to_string())?
}

/// The bus floor server (see [`floor`]), killed on drop.
pub(crate) struct FloorProc {
    pub(crate) child: Child,
    pub(crate) name: String,
}

/// What a pair-rate window cost: the server's CPU per pair (µs) and how
/// busy the machine was (0..1).
pub(crate) struct PairCost {
    pub(crate) rate: f64,
    pub(crate) cpu_per_pair_us: f64,
    pub(crate) busy: f64,
}

pub(crate) async fn costed<F: std::future::Future<Output = Result<f64>>>(
    pid: u32,
    secs: f64,
    window: F,
) -> Result<PairCost> {
    let (c0, m0) = (process_cpu(pid)?, machine_cpu());
    let rate = window.await?;
    let (c1, m1) = (process_cpu(pid)?, machine_cpu());
    let pairs = (rate * secs).max(1.0);
    Ok(PairCost {
        rate,
        cpu_per_pair_us: (c1 - c0).as_secs_f64() * 1e6 / pairs,
        busy: (m1.0 - m0.0) as f64 / (m1.1 - m0.1).max(1) as f64,
    })
}

impl FloorProc {
    /// The bus floor; with `kernel_ns`, the kernel floor in that namespace.
    pub(crate) fn start(env: &Env, kernel_ns: Option<&str>) -> Result<FloorProc> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut cmd = match kernel_ns {
            None => Command::new(&exe),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
        };
        cmd.args(["--serve-floor", &env.bus_addr]);
        if kernel_ns.is_some() {
            cmd.arg("--kernel");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the floor server: {e}"))?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("floor server: no stdout")?;
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| format!("floor server: {e}"))?;
        let name = line.trim().to_owned();
        if !name.starts_with(':') {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("floor server did not start (said '{name}')"));
        }
        Ok(FloorProc { child, name })
    }

    /// Ensure+release pairs/s against the floor server.
    pub(crate) async fn pair_rate(
        &self,
        conn: &Connection,
        callers: usize,
        secs: f64,
    ) -> Result<f64> {
        let target = Target {
            dest: self.name.as_str(),
            path: floor::PATH,
            iface: floor::IFACE,
        };
        rate(conn, callers, secs, |conn, c, n| async move {
            let id = format!("bench-floor{callers}-{c}-{n}");
            ensure_at(&conn, target, &id).await?;
            release_at(&conn, target, &id).await
        })
        .await
    }
}

impl Drop for FloorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
