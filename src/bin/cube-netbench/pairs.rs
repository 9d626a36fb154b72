//! The agent phases: warm and cold ensures, ensure+release pairs/s over
//! D-Bus and varlink (and the VMM's lifecycle), the signals a pair emits,
//! filling to N networks, pairs/s under flow load, and a baseline agent.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cube_network_agent::dbus::BUS_NAME;
use zbus::Connection;

use crate::calls::{CONCURRENT_CALLERS, Error, Result, ensure, open_tap, release, timed};
use crate::env::Env;
use crate::floors::{costed, floor_journal_append, per_second, rate};
use crate::report::{Lat, Row, ratio, row};

pub(crate) struct Warm {
    pub(crate) ensure: Lat,
    pub(crate) release: Lat,
}

pub(crate) async fn warm_ensure_release(conn: &Connection, samples: usize) -> Result<Warm> {
    let (mut e, mut r) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for i in 0..samples {
        let id = format!("bench-warm-{i}");
        e.push(timed(ensure(conn, &id)).await?);
        r.push(timed(release(conn, &id)).await?);
    }
    Ok(Warm {
        ensure: Lat::new(e),
        release: Lat::new(r),
    })
}

/// Times only the ensure; releases each network untimed so the count stays flat.
pub(crate) async fn cold_ensures(conn: &Connection, phase: &str, samples: usize) -> Result<Lat> {
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        let id = format!("bench-{phase}-{i}");
        v.push(timed(ensure(conn, &id)).await?);
        release(conn, &id).await?;
    }
    Ok(Lat::new(v))
}

/// Ensure+release pairs per second over `secs` with `callers` tasks.
pub(crate) async fn pair_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, c, n| async move {
        let id = format!("bench-tput{callers}-{c}-{n}");
        ensure(&conn, &id).await?;
        release(&conn, &id).await
    })
    .await
}

/// Ensure, OpenTap (the fd closed at once), Release: what a VMM does.
pub(crate) async fn vmm_pair_rate(conn: &Connection, callers: usize, secs: f64) -> Result<f64> {
    rate(conn, callers, secs, |conn, c, n| async move {
        let id = format!("bench-vmm{callers}-{c}-{n}");
        ensure(&conn, &id).await?;
        open_tap(&conn, &id).await?;
        release(&conn, &id).await
    })
    .await
}

/// One varlink call on `stream`: the reply's `parameters`, or its error.
pub(crate) async fn varlink_call_on(
    stream: &mut tokio::net::UnixStream,
    method: &str,
    parameters: serde_json::Value,
) -> Result<serde_json::Value> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut msg =
        serde_json::to_vec(&serde_json::json!({ "method": method, "parameters": parameters }))
            .map_err(|e| e.to_string())?;
    msg.push(0);
    stream
        .write_all(&msg)
        .await
        .map_err(|e| format!("{method}: {e}"))?;
    let mut reply = vec![];
    let mut r = tokio::io::BufReader::new(&mut *stream);
    r.read_until(0, &mut reply)
        .await
        .map_err(|e| format!("{method}: {e}"))?;
    reply.pop();
    let v: serde_json::Value =
        serde_json::from_slice(&reply).map_err(|e| format!("{method} reply: {e}"))?;
    if let Some(e) = v.get("error") {
        return Err(format!("{method}: {e} {}", v["parameters"]));
    }
    Ok(v["parameters"].clone())
}

/// Ensure+release pairs/s over varlink, a connection per caller.
pub(crate) async fn varlink_pair_rate(path: &Path, callers: usize, secs: f64) -> Result<f64> {
    per_second(callers, secs, |c, deadline| async move {
        let mut stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|e| format!("varlink {}: {e}", path.display()))?;
        let mut n = 0usize;
        while Instant::now() < deadline {
            let id = format!("bench-vl{callers}-{c}-{n}");
            varlink_call_on(
                &mut stream,
                "org.cube.NetworkAgent.EnsureNetwork",
                serde_json::json!({ "sandbox_id": id }),
            )
            .await?;
            varlink_call_on(
                &mut stream,
                "org.cube.NetworkAgent.ReleaseNetwork",
                serde_json::json!({ "sandbox_id": id }),
            )
            .await?;
            n += 1;
        }
        Ok(n)
    })
    .await
}

/// Pairs/s of this build and of `base`, each on a fresh instance, in
/// turns (3 rounds), so drift on a shared machine hits both alike.
pub(crate) async fn baseline_rows(
    env: &mut Env,
    conn: &Connection,
    base: &Path,
    n: usize,
    secs: f64,
    rows: &mut Vec<Row>,
) -> Result<()> {
    eprintln!(
        "[5b/10] ensure+release pairs/s, this build and {} in turns",
        base.display()
    );
    let this = env.agent_bin.clone();
    let (mut mine, mut theirs) = (vec![], vec![]);
    let (mut mine_cpu, mut theirs_cpu) = (vec![], vec![]);
    for round in 0..3 {
        for (bin, out, cpu) in [
            (&this, &mut mine, &mut mine_cpu),
            (&base.to_path_buf(), &mut theirs, &mut theirs_cpu),
        ] {
            env.agent_bin = bin.clone();
            let (ns, dir) = env.new_instance()?;
            env.start_agent(&ns, &dir, 64, n).await?;
            for i in 0..20 {
                let id = format!("bench-base-warm-{round}-{i}");
                ensure(conn, &id).await?;
                release(conn, &id).await?;
            }
            let cost = costed(
                env.agent_pid()?,
                secs,
                pair_rate(conn, CONCURRENT_CALLERS, secs),
            )
            .await?;
            out.push(cost.rate);
            cpu.push(cost.cpu_per_pair_us);
            env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        }
    }
    env.agent_bin = this;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (m, t) = (median(&mut mine), median(&mut theirs));
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    rows.push(
        row(
            format!("pairs/s, {CONCURRENT_CALLERS} callers: this build vs --baseline-agent (median of 3)"),
            format!("{m:.0}/s ({})", show(&mine)),
            format!("baseline {t:.0}/s ({})", show(&theirs)),
            format!("{:.2}x", m / t.max(1.0)),
            ">= 0.9x",
        )
        .met(m >= 0.9 * t),
    );
    let (mc, tc) = (median(&mut mine_cpu), median(&mut theirs_cpu));
    rows.push(row(
        format!(
            "agent CPU per pair, {CONCURRENT_CALLERS} callers: this build vs --baseline-agent (median of 3)"
        ),
        format!("{mc:.0} µs ({})", show(&mine_cpu)),
        format!("baseline {tc:.0} µs ({})", show(&theirs_cpu)),
        format!("{:.2}x", mc / tc.max(1.0)),
        "-",
    ));
    Ok(())
}

/// Counts the agent's signals on a connection of its own (a match rule
/// for every signal the agent's name sends), in the background.
pub(crate) struct SignalCounter {
    pub(crate) count: Arc<AtomicU64>,
    pub(crate) task: tokio::task::JoinHandle<()>,
    pub(crate) _conn: Connection,
}

impl SignalCounter {
    pub(crate) async fn start(env: &Env) -> Result<SignalCounter> {
        use futures::StreamExt;
        let conn = env.connect().await?;
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .sender(BUS_NAME)
            .map_err(|e| format!("match rule: {e}"))?
            .build();
        let mut stream = zbus::MessageStream::for_match_rule(rule, &conn, Some(65_536))
            .await
            .map_err(|e| format!("AddMatch: {e}"))?;
        let count = Arc::new(AtomicU64::new(0));
        let c = count.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(_)) = stream.next().await {
                c.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(SignalCounter {
            count,
            task,
            _conn: conn,
        })
    }

    /// Stops counting once the signals of the last calls had time to
    /// arrive; the total.
    pub(crate) async fn stop(self) -> u64 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        self.task.abort();
        self.count.load(Ordering::Relaxed)
    }
}

/// Ensures networks `from..to` with 16 callers.
pub(crate) async fn fill(conn: &Connection, from: usize, n: usize) -> Result<Duration> {
    let next = Arc::new(AtomicUsize::new(from));
    let start = Instant::now();
    let tasks = (0..CONCURRENT_CALLERS).map(|_| {
        let (conn, next) = (conn.clone(), next.clone());
        async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<(), Error>(());
                }
                ensure(&conn, &format!("bench-fill-{i}")).await?;
            }
        }
    });
    futures::future::try_join_all(tasks).await?;
    Ok(start.elapsed())
}

/// Release cost and pair throughput at one size of the flow map.
pub(crate) struct FlowPoint {
    pub(crate) flows: usize,
    pub(crate) release: Lat,
    pub(crate) pairs: f64,
}

/// Fills the agent's pinned `ct` map with synthetic flows (0, 10k, 100k)
/// and measures ReleaseNetwork and ensure+release pairs/s at each size.
/// The flows belong to a few live sandboxes (their generation read from
/// `by_ip`): the reaper drops flows of addresses nobody owns. None when the
/// agent runs without the eBPF datapath.
pub(crate) async fn flow_load(
    conn: &Connection,
    pins: &Path,
    samples: usize,
    secs: f64,
) -> Result<Option<Vec<FlowPoint>>> {
    use aya::maps::{HashMap as BpfMap, Map, MapData};
    use cube_network_agent::datapath::maps::{DP_CT_SNAT, DpCtKey, DpCtVal, DpTap};
    if !pins.join("ct").exists() {
        return Ok(None);
    }
    for i in 0..16 {
        ensure(conn, &format!("bench-flow-owner-{i}")).await?;
    }
    let open = |name: &str| {
        MapData::from_pin(pins.join(name)).map_err(|e| format!("opening the pinned {name}: {e}"))
    };
    let by_ip: BpfMap<MapData, u32, DpTap> =
        BpfMap::try_from(Map::HashMap(open("by_ip")?)).map_err(|e| e.to_string())?;
    let owners: Vec<(u32, u64)> = by_ip
        .iter()
        .flatten()
        .map(|(ip, t)| (ip, t.generation))
        .collect();
    if owners.is_empty() {
        return Err("no sandbox in the pinned by_ip map".into());
    }
    let mut ct: BpfMap<MapData, DpCtKey, DpCtVal> =
        BpfMap::try_from(Map::LruHashMap(open("ct")?)).map_err(|e| e.to_string())?;
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .map_err(|e| e.to_string())?;
    let mut points = vec![];
    let mut filled = 0usize;
    for flows in [0usize, 10_000, 100_000] {
        while filled < flows {
            let i = filled as u32;
            let (sandbox_ip, generation) = owners[filled % owners.len()];
            // 100.64.0.0/10 remotes, one per flow: no key repeats.
            let remote = 0x6440_0000u32 + i;
            let key = DpCtKey {
                sandbox_ip,
                remote_ip: u32::from_ne_bytes(remote.to_be_bytes()),
                guest_port: (40000 + (i % 20000) as u16).to_be(),
                remote_port: 443u16.to_be(),
                proto: libc::IPPROTO_TCP as u8,
                pad: [0; 3],
            };
            let val = DpCtVal {
                last_seen_ns: now,
                nat_port: (40000 + (i % 20000) as u16).to_be(),
                kind: DP_CT_SNAT,
                state: 0,
                generation,
                ..Default::default()
            };
            ct.insert(key, val, 0)
                .map_err(|e| format!("filling ct ({filled} flows): {e}"))?;
            filled += 1;
        }
        let warm = warm_ensure_release(conn, samples).await?;
        let pairs = pair_rate(conn, CONCURRENT_CALLERS, secs).await?;
        eprintln!(
            "  {flows} flows: release p50 {:.0} µs, {pairs:.0} pairs/s",
            warm.release.p50()
        );
        points.push(FlowPoint {
            flows,
            release: warm.release,
            pairs,
        });
    }
    Ok(Some(points))
}

/// Cold EnsureNetwork at `nets` networks, and its p50 against the same
/// run's at 0 networks (the attach cost must not grow with the node).
pub(crate) async fn cold_point(
    env: &mut Env,
    conn: &Connection,
    rows: &mut Vec<Row>,
    nets: &str,
    cold0: &Lat,
    samples: usize,
    floor_no_disk: f64,
) -> Result<()> {
    let floor_cold = floor_no_disk + floor_journal_append(&env.tmp, (samples / 2).max(10))?.p50();
    let phase: String = format!("cold{nets}")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let coldn = cold_ensures(conn, &phase, samples).await?;
    rows.push(
        row(
            format!("cold EnsureNetwork, {nets}, p50 / p99"),
            coldn.show(),
            format!("zbus+fdatasync+TAP {floor_cold:.0} µs"),
            ratio(coldn.p50(), floor_cold),
            "p50 <= 2000 µs (10k)",
        )
        .met(coldn.p50() <= 2000.0),
    );
    let r = coldn.p50() / cold0.p50();
    rows.push(
        row(
            format!("cold EnsureNetwork p50, {nets} / 0 nets"),
            format!("{r:.2}"),
            "-",
            "-",
            "<= 1.2",
        )
        .met(r <= 1.2),
    );
    Ok(())
}
