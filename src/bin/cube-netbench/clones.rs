//! The clone phase: EnsureNetwork with clone_of, and how soon each
//! clone's first frame is answered from its OpenTap.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cube_network_agent::dbus::{BUS_NAME, MANAGER_PATH};
use zbus::Connection;
use zbus::zvariant::{OwnedFd, OwnedValue};

use crate::calls::{AGENT, IFACE, Result, ensure_with, release, timed};
use crate::report::Lat;

/// Clones of one source (two port mappings, egress rules): `n` made one
/// after another (each released before the next, as the warm rows),
/// alternating with the same spec given explicitly, then
/// `n` kept at once made by `callers` tasks next to `n` networks given the
/// same spec, made the same way (the warm pool runs dry in both);
/// released untimed.
pub(crate) struct Clones {
    pub(crate) serial: Lat,
    pub(crate) explicit: Lat,
    pub(crate) burst: Lat,
    pub(crate) explicit_burst: Lat,
    /// Each kept clone: from OpenTap's reply to the datapath's answer to
    /// its first frame; and the same for the source, a network made long
    /// before (the reference).
    pub(crate) first_answer: Lat,
    pub(crate) source_first_answer: Lat,
}

/// The node's guest identity, from GetNetwork: (guest MAC, guest IP,
/// gateway IP), what a restored guest's frames carry.
pub(crate) async fn guest_identity(
    conn: &Connection,
    id: &str,
) -> Result<([u8; 6], [u8; 4], [u8; 4])> {
    let net: HashMap<String, OwnedValue> = conn
        .call_method(
            Some(BUS_NAME),
            MANAGER_PATH,
            Some(IFACE),
            "GetNetwork",
            &(id,),
        )
        .await
        .map_err(|e| format!("GetNetwork({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("GetNetwork({id}) reply: {e}"))?;
    let field = |k: &str| -> Result<String> {
        net.get(k)
            .and_then(|v| String::try_from(v.try_clone().ok()?).ok())
            .ok_or_else(|| format!("GetNetwork({id}): no {k}"))
    };
    let mac: Vec<u8> = field("guest_mac")?
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).map_err(|e| e.to_string()))
        .collect::<Result<_>>()?;
    let ip = |k: &str| -> Result<[u8; 4]> {
        // guest_ip comes with its prefix length ("169.254.68.6/30").
        Ok(field(k)?
            .split('/')
            .next()
            .unwrap_or_default()
            .parse::<std::net::Ipv4Addr>()
            .map_err(|e| e.to_string())?
            .octets())
    };
    Ok((
        mac.try_into().map_err(|_| "guest_mac: not 6 bytes")?,
        ip("guest_ip")?,
        ip("gateway_ip")?,
    ))
}

/// What a VMM restoring a snapshot does first: OpenTap, then the guest's
/// first frame. An ARP request for the gateway is written every 5 ms
/// until the datapath's proxy ARP answers it (`from_guest` runs for the
/// TAP with the sandbox's entry): the time from OpenTap's reply to the
/// answer.
pub(crate) async fn first_answer(
    conn: &Connection,
    id: &str,
    who: ([u8; 6], [u8; 4], [u8; 4]),
) -> Result<Duration> {
    let fd: OwnedFd = conn
        .call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "OpenTap", &(id,))
        .await
        .map_err(|e| format!("OpenTap({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("OpenTap({id}) reply: {e}"))?;
    let fd = std::os::fd::OwnedFd::from(fd);
    let t = Instant::now();
    let id = id.to_owned();
    tokio::task::spawn_blocking(move || {
        arp_until_answered(&fd, who, t, Duration::from_secs(5))
            .map_err(|e| format!("{id}: the first frame after OpenTap: {e}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

pub(crate) fn arp_until_answered(
    fd: &std::os::fd::OwnedFd,
    (mac, guest_ip, gateway_ip): ([u8; 6], [u8; 4], [u8; 4]),
    t: Instant,
    limit: Duration,
) -> Result<Duration> {
    use std::os::fd::AsRawFd;
    // The agent's TAPs carry a 12-byte virtio-net header (zero: no offload).
    const VNET: usize = 12;
    let mut req = vec![0u8; VNET];
    req.extend_from_slice(&[0xff; 6]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&guest_ip);
    req.extend_from_slice(&[0; 6]);
    req.extend_from_slice(&gateway_ip);
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl(2) on an fd this function borrows; only its flags change.
    unsafe {
        let fl = libc::fcntl(raw, libc::F_GETFL);
        libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let mut buf = vec![0u8; VNET + 65550];
    while t.elapsed() < limit {
        // SAFETY: `req` is a live buffer of `req.len()` bytes; write(2) only reads it.
        unsafe { libc::write(raw, req.as_ptr().cast(), req.len()) };
        let mut pfd = libc::pollfd {
            fd: raw,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 5) };
        loop {
            // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
            let n = unsafe { libc::read(raw, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= VNET as isize {
                break;
            }
            let f = &buf[VNET..n as usize];
            if f.len() >= 42
                && f[12..14] == [8, 6]
                && f[20..22] == [0, 2]
                && f[28..32] == gateway_ip
            {
                return Ok(t.elapsed());
            }
        }
    }
    Err(format!("no proxy-ARP answer within {limit:?}"))
}

/// `None`: the agent under test predates `clone_of` (an older build as
/// `--agent`), so there are no clone rows.
pub(crate) async fn clone_phase(
    conn: &Connection,
    n: usize,
    callers: usize,
) -> Result<Option<Clones>> {
    let owned = |v: zbus::zvariant::Value<'_>| -> Result<OwnedValue> {
        OwnedValue::try_from(v).map_err(|e| e.to_string())
    };
    let source_opts = || -> Result<HashMap<String, OwnedValue>> {
        Ok(HashMap::from([
            (
                "port_mappings".to_string(),
                owned(zbus::zvariant::Value::from(vec![
                    ("tcp", 80u16, 0u16, ""),
                    ("udp", 53u16, 0u16, ""),
                ]))?,
            ),
            (
                "allow_out".to_string(),
                owned(zbus::zvariant::Value::from(vec![
                    "10.1.0.0/16",
                    "example.com",
                ]))?,
            ),
        ]))
    };
    ensure_with(conn, AGENT, "bench-clone-src", source_opts()?).await?;
    let clone_opts = || -> Result<HashMap<String, OwnedValue>> {
        Ok(HashMap::from([(
            "clone_of".to_string(),
            owned(zbus::zvariant::Value::from("bench-clone-src"))?,
        )]))
    };
    // As the warm rows, each released (untimed) before the next, so the
    // warm pool never runs dry; alternating with the same spec given
    // explicitly, so the difference is clone_of's own.
    let (mut serial, mut explicit) = (Vec::with_capacity(n), Vec::with_capacity(n));
    if let Err(e) = ensure_with(conn, AGENT, "bench-clone-probe", clone_opts()?).await {
        release(conn, "bench-clone-src").await?;
        return if e.contains("unknown option 'clone_of'") {
            Ok(None)
        } else {
            Err(e)
        };
    }
    release(conn, "bench-clone-probe").await?;
    for i in 0..n {
        let id = format!("bench-clone-s{i}");
        serial.push(timed(ensure_with(conn, AGENT, &id, clone_opts()?)).await?);
        release(conn, &id).await?;
        let id = format!("bench-explicit-s{i}");
        explicit.push(timed(ensure_with(conn, AGENT, &id, source_opts()?)).await?);
        release(conn, &id).await?;
    }
    // `callers` tasks share the n calls.
    async fn burst(
        conn: &Connection,
        n: usize,
        callers: usize,
        prefix: &str,
        opts: &(dyn Fn() -> Result<HashMap<String, OwnedValue>> + Sync),
    ) -> Result<Lat> {
        let next = AtomicUsize::new(0);
        let per: Vec<Vec<Duration>> = futures::future::try_join_all((0..callers).map(|_| async {
            let mut v = vec![];
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, String>(v);
                }
                let id = format!("{prefix}{i}");
                v.push(timed(ensure_with(conn, AGENT, &id, opts()?)).await?);
            }
        }))
        .await?;
        Ok(Lat::new(per.into_iter().flatten().collect()))
    }
    async fn release_all(conn: &Connection, n: usize, prefix: &str) -> Result<()> {
        for i in 0..n {
            release(conn, &format!("{prefix}{i}")).await?;
        }
        Ok(())
    }
    let burst_clones = burst(conn, n, callers, "bench-clone-b", &clone_opts).await?;
    // The kept clones' first frames, all restored at once (as many tasks
    // as callers); then the source's, one at a time, as the reference.
    let who = guest_identity(conn, "bench-clone-src").await?;
    let next = AtomicUsize::new(0);
    let firsts: Vec<Vec<Duration>> = futures::future::try_join_all((0..callers).map(|_| async {
        let mut v = vec![];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                return Ok::<_, String>(v);
            }
            v.push(first_answer(conn, &format!("bench-clone-b{i}"), who).await?);
        }
    }))
    .await?;
    let mut source_firsts = Vec::with_capacity(10);
    for _ in 0..10 {
        source_firsts.push(first_answer(conn, "bench-clone-src", who).await?);
    }
    release_all(conn, n, "bench-clone-b").await?;
    let explicit_burst = burst(conn, n, callers, "bench-explicit-b", &source_opts).await?;
    release_all(conn, n, "bench-explicit-b").await?;
    release(conn, "bench-clone-src").await?;
    Ok(Some(Clones {
        serial: Lat::new(serial),
        explicit: Lat::new(explicit),
        burst: burst_clones,
        explicit_burst,
        first_answer: Lat::new(firsts.into_iter().flatten().collect()),
        source_first_answer: Lat::new(source_firsts),
    }))
}
