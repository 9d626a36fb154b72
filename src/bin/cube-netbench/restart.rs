//! Restart and upgrade in place: SIGKILL and SIGTERM then READY again,
//! and a next build taking over every TAP (its from_guest runs).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use cube_network_agent::dbus::{BUS_NAME, MANAGER_PATH};
use zbus::Connection;

use crate::args::Args;
use crate::calls::{IFACE, Result, ping};
use crate::env::{Env, in_netns};
use crate::report::{Row, ms, row};

/// The SIGTERM restart is measured too only when exiting is this quick.
pub(crate) const QUICK_EXIT: Duration = Duration::from_secs(10);

/// The running agent's programs and tags (Health's datapath_programs).
pub(crate) async fn programs(conn: &Connection) -> Result<HashMap<String, u64>> {
    let (_, checks): (bool, Vec<(String, bool, String)>) = conn
        .call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "Health", &())
        .await
        .map_err(|e| format!("Health: {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("Health: {e}"))?;
    let d = checks
        .iter()
        .find(|c| c.0 == "datapath_programs")
        .map(|c| c.2.clone())
        .ok_or("Health has no datapath_programs check")?;
    let list = d
        .strip_prefix("this build's programs: ")
        .and_then(|r| r.split(';').next())
        .ok_or_else(|| format!("unexpected datapath_programs: {d}"))?;
    list.split(", ")
        .map(|p| {
            let (name, tag) = p.split_once(' ').ok_or_else(|| format!("bad entry {p}"))?;
            let tag = u64::from_str_radix(tag, 16).map_err(|e| format!("{tag}: {e}"))?;
            Ok((name.to_owned(), tag))
        })
        .collect()
}

/// How long after `since` the shared block's filter (every bound TAP's
/// from_guest) ran the program tagged `tag`: None if it already did at
/// the first look.
pub(crate) async fn until_block_runs(
    ns: &str,
    tag: &u64,
    since: Instant,
) -> Result<Option<Duration>> {
    let (ns, tag) = (ns.to_owned(), *tag);
    let mut first = true;
    loop {
        let ns2 = ns.clone();
        let now = tokio::task::spawn_blocking(move || in_netns(&ns2, block_tag))
            .await
            .map_err(|e| e.to_string())??;
        if now == Some(tag) {
            return Ok((!first).then(|| since.elapsed()));
        }
        first = false;
        if since.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "the block still runs {now:?} 30 s after READY, not {tag:x}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

pub(crate) fn block_tag() -> Result<Option<u64>> {
    use cube_network_agent::datapath::tc;
    let block = cube_network_agent::config::Config::default().tc_block;
    Ok(tc::bpf_filters(tc::Target::Block(block))
        .map_err(|e| format!("dumping the block's filters: {e}"))?
        .first()
        .map(|f| f.tag))
}

/// [8/10] and [9/10]: the agent killed and restarted, stopped and
/// restarted, and upgraded in place to `--next-agent`, with `n` networks.
pub(crate) async fn restart(
    env: &mut Env,
    args: &Args,
    conn: &Connection,
    (ns, dir): (&str, &Path),
    n: usize,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let max = args.networks_max;
    eprintln!("[8/10] restart with {n} networks");
    let killed = env.stop_agent(nix::sys::signal::Signal::SIGKILL).await?;
    rows.push(row(
        format!("SIGKILL -> agent process gone, {n} nets"),
        ms(killed),
        "-",
        "-",
        "- (kernel closes every TAP fd)",
    ));
    let after_kill = env.start_agent(ns, dir, 0, max).await?;
    ping(conn).await?;
    rows.push(
        row(
            format!("restart after SIGKILL: spawn -> READY, {n} nets"),
            ms(after_kill),
            "-",
            "-",
            "<= 1000 ms (10k)",
        )
        .met(after_kill <= Duration::from_secs(1)),
    );
    if killed < QUICK_EXIT {
        let stop = env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        let after_term = env.start_agent(ns, dir, 0, max).await?;
        rows.push(row(
            format!("SIGTERM -> exit, {n} nets"),
            ms(stop),
            "-",
            "-",
            "-",
        ));
        rows.push(
            row(
                format!("restart after SIGTERM: spawn -> READY, {n} nets"),
                ms(after_term),
                "-",
                "-",
                "<= 1000 ms (10k)",
            )
            .met(after_term <= Duration::from_secs(1)),
        );
    } else {
        rows.push(row(
            "SIGTERM stop + restart",
            format!("skipped (exit took {:.0} s)", killed.as_secs_f64()),
            "-",
            "-",
            "-",
        ));
    }

    if let Some(next) = &args.next_agent {
        eprintln!(
            "[9/10] upgrade in place to {} with {n} networks",
            next.display()
        );
        let before = programs(conn).await?;
        env.stop_agent(nix::sys::signal::Signal::SIGTERM).await?;
        let this = std::mem::replace(&mut env.agent_bin, next.clone());
        let ready = env.start_agent(ns, dir, 0, max).await?;
        let at_ready = Instant::now();
        let after = programs(conn).await?;
        if after.get("from_guest") == before.get("from_guest") {
            return Err(format!(
                "--next-agent runs the same from_guest ({:?}): build one with tests/upgrade/build-next.sh",
                after.get("from_guest")
            ));
        }
        let switched = until_block_runs(ns, &after["from_guest"], at_ready).await?;
        env.agent_bin = this;
        rows.push(row(
            format!("upgrade (SIGTERM, new build): spawn -> READY, {n} nets"),
            ms(ready),
            "-",
            "-",
            "- (includes the verifier: ~1 s)",
        ));
        rows.push(
            row(
                format!("READY -> every TAP on the new from_guest, {n} nets"),
                match switched {
                    None => "0 ms (switched before READY)".into(),
                    Some(d) => ms(d),
                },
                "-",
                "-",
                "<= 1000 ms",
            )
            .met(switched.is_none_or(|d| d <= Duration::from_secs(1))),
        );
    } else {
        eprintln!("[9/10] upgrade in place: skipped (no --next-agent)");
    }
    Ok(())
}
